"""`raytf` command line: argument parsing and exit codes only; the work happens in raytf.fit.

Exit codes: 0 success, 1 training or startup failed, 2 bad job spec, 3 resources not available in time,
130 interrupted.
"""
from __future__ import annotations

import sys

import click

from raytf.errors import RaytfError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="raytf")
def main() -> None:
    """Distributed TensorFlow training on Ray."""


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--address", default=None, help="Ray cluster to use ('auto' or HOST:PORT); default: an embedded local Ray.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key, e.g. --set train.epochs=3 (repeatable).")
@click.option("--quiet", "-q", is_flag=True, help="No progress display; only errors and the final path.")
def run(job_file: str, address: str | None, settings: tuple[str, ...], quiet: bool) -> None:
    """Train the job in JOB_FILE (YAML) on the Ray cluster."""
    from raytf import fit
    from raytf.report import ProgressDisplay
    from raytf.spec import parse_set_options

    display = ProgressDisplay(quiet=quiet)
    try:
        result = fit(job_file, parse_set_options(list(settings)), address=address, display=display)
    except RaytfError as exc:
        click.echo(f"raytf: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("raytf: interrupted; actors and placement group released", err=True)
        sys.exit(130)
    final = result.final
    shown = "  ".join(f"{k} {v:.4f}" for k, v in final.items() if isinstance(v, float) and k != "seconds")
    click.echo(f"raytf: {result.name} {result.status}: {shown}")
    click.echo(f"raytf: result {result.output_dir}/result.json, model {result.model_path}")


if __name__ == "__main__":
    main()
