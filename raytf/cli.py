"""`raytf` command line: argument parsing and exit codes only; the work happens in raytf.fit.

Exit codes: 0 success, 1 training or startup failed, 2 bad job spec, 3 resources not available in time,
130 interrupted.
"""
from __future__ import annotations

import functools
import signal
import sys

import click

from raytf.console_exit import exit_on_error, exit_process, interrupt
from raytf.errors import RaytfError, SpecError

_VERBOSE_HELP = ("Also show Ray's and TensorFlow's own output: the workers' logs, TensorFlow's start-up lines "
                 "(by default only raytf's lines; the workers' logs stay in Ray's session folder).")


class _Main(click.Group):
    """Every command's exit, whatever its path, through `exit_process`: after an abandoned store call pyarrow's S3
    client would otherwise hold the process at exit without end."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, **kwargs)
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                exit_process(exc.code or 0)
            raise


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="raytf")
def main() -> None:
    """Distributed TensorFlow training on Ray."""
    from raytf import tf_import

    tf_import.set_lean_driver()  # this process is raytf's own: its TensorFlow import may skip Keras's extras


def _stderr_filtered(command):
    """The command's whole life (to the process's exit): TensorFlow's native start-up lines are kept off
    stderr, whenever TensorFlow is imported (raytf.driver.quiet); not with -v, nor with a TF_CPP_MIN_LOG_LEVEL
    of the user's own."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from raytf.driver import quiet

        quiet.filter_stderr(bool(kwargs.get("verbose", False)))
        return command(*args, **kwargs)
    return wrapper


class _ResumeAutoCommand(click.Command):
    """`--resume auto` (and `--resume=auto`) become the hidden flag --resume-auto, so that a bare `--resume`
    stays a flag wherever it stands (`raytf run --resume job.yaml` too)."""

    def parse_args(self, ctx, args):
        rewritten, i = [], 0
        while i < len(args):
            if args[i] == "--resume" and i + 1 < len(args) and args[i + 1] == "auto":
                rewritten.append("--resume-auto")
                i += 2
                continue
            rewritten.append("--resume-auto" if args[i] == "--resume=auto" else args[i])
            i += 1
        return super().parse_args(ctx, rewritten)


@main.command(cls=_ResumeAutoCommand)
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--address", default=None, help="Ray cluster to use ('auto' or HOST:PORT); default: an embedded local Ray.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key, e.g. --set train.epochs=3 (repeatable).")
@click.option("--quiet", "-q", is_flag=True, help="No progress display; only errors and the final path.")
@click.option("--resume", is_flag=True, help=("Continue from the latest checkpoint in checkpoint.dir (default "
                                              "<output.dir>/checkpoints). `--resume auto`: "
                                              "continue if there is one, start if not, train nothing if the run already "
                                              "succeeded in output.dir (as `resume: auto` in the spec)."))
@click.option("--resume-auto", is_flag=True, hidden=True)
@click.option("--verbose", "-v", is_flag=True, help=_VERBOSE_HELP)
@_stderr_filtered
def run(job_file: str, address: str | None, settings: tuple[str, ...], quiet: bool, resume: bool, resume_auto: bool,
        verbose: bool) -> None:
    """Train the job in JOB_FILE (YAML) on the Ray cluster."""
    from raytf import fit
    from raytf.driver.report import ProgressDisplay
    from raytf.job import parse_set_options

    display = ProgressDisplay(quiet=quiet)
    # `ray job stop` / `raytf stop` send SIGTERM: take the Ctrl-C path, so actors, the placement group
    # and result.json are dealt with before exiting.
    signal.signal(signal.SIGTERM, interrupt)
    with exit_on_error("raytf: interrupted; actors and placement group released", verbose=verbose):
        result = fit(job_file, parse_set_options(list(settings)), address=address, display=display,
                     resume="auto" if resume_auto else (True if resume else None), verbose=verbose)
    final = result.final
    from raytf.driver.report import fmt

    shown = "  ".join(f"{k} {fmt(v)}" for k, v in final.items() if isinstance(v, float) and k != "seconds")
    click.echo(f"raytf: {result.name} {result.status}: {shown}")
    exported = ", ".join(f"{fmt} {path}" for fmt, path in result.exports.items()) or "no model"
    click.echo(f"raytf: result {result.output_dir}/result.json; {exported}")


@main.group()
def data() -> None:
    """Look at Parquet data sets; make synthetic ones."""


@data.command("inspect")
@click.argument("path")
@click.option("--workers", "-n", default=2, show_default=True, type=click.IntRange(1, 4096),
              help="Show the split over this many workers (1-4096).")
@_stderr_filtered
def data_inspect(path: str, workers: int) -> None:
    """Schema, row count, files, row groups of PATH (file, directory, glob or URI) and its split."""
    from raytf.data_scan import inspect_report

    with exit_on_error():
        click.echo(inspect_report(path, workers))


@data.command("synth-criteo")
@click.argument("out_dir")
@click.option("--rows", default=100_000, show_default=True, type=click.IntRange(min=1))
@click.option("--files", default=4, show_default=True)
@click.option("--row-group-size", default=8192, show_default=True)
@click.option("--seed", default=0, show_default=True)
@_stderr_filtered
def data_synth_criteo(out_dir: str, rows: int, files: int, row_group_size: int, seed: int) -> None:
    """Write a click-through table shaped like Criteo's (label, I1..I13, C1..C26) as Parquet."""
    from raytf.synthetic import criteo_like

    criteo_like(out_dir, rows, files=files, row_group_size=row_group_size, seed=seed)
    click.echo(f"raytf: wrote {rows:,} rows in {files} file(s) to {out_dir}")


@main.command("tune")
@click.argument("sweep_file", type=click.Path(dir_okay=False))
@click.option("--address", default=None, help="Ray cluster to use ('auto' or HOST:PORT); default: an embedded local Ray.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Override a spec or tune key, e.g. --set train.epochs=3, --set tune.num_samples=2, "
                   "--set 'tune.space.train.global_batch_size={grid: [64, 128]}' (repeatable).")
@click.option("--quiet", "-q", is_flag=True, help="No per-trial progress lines; only the table and the paths.")
@click.option("--resume", is_flag=True, help="Continue the stopped sweep in output.dir (finished trials are kept).")
@click.option("--verbose", "-v", is_flag=True, help=_VERBOSE_HELP)
@_stderr_filtered
def tune_command(sweep_file: str, address: str | None, settings: tuple[str, ...], quiet: bool, resume: bool,
                 verbose: bool) -> None:
    """Sweep SWEEP_FILE (a job spec plus a tune: section) with Ray Tune; every trial is a distributed job.

    Exit codes as for `run`; 1 also when no trial completed or any trial failed (one line each; Tune's own
    traceback with -v), 130 when interrupted (--resume continues)."""
    from raytf import sweep_report, tune
    from raytf.driver.report import ProgressDisplay
    from raytf.job import parse_set_options

    signal.signal(signal.SIGTERM, interrupt)  # as for run: the Ctrl-C path, the sweep's files shipped
    with exit_on_error("raytf: interrupted; `raytf tune --resume` continues the sweep"):
        result = tune(sweep_file, parse_set_options(list(settings)), address=address,
                      display=ProgressDisplay(quiet=quiet), resume=resume, verbose=verbose)
    click.echo(result.table)
    if result.best is not None:
        click.echo(f"raytf: best {result.best['point']}: {result.metric} {result.best['final']:.4g}; "
                   f"job spec {result.best_spec_path}; "
                   + (", ".join(f"{fmt} {path}" for fmt, path in result.best_exports.items()) or "no model"))
    click.echo(f"raytf: sweep {result.sweep_json}, plot {result.plot_path}")
    if result.interrupted:
        click.echo("raytf: interrupted; re-run with --resume to continue the unfinished trials", err=True)
        sys.exit(130)
    if result.best is None:
        click.echo("raytf: error: no trial completed; see the error column above and each trial's result.json",
                   err=True)
        sys.exit(1)
    failed = [row for row in result.rows if row["status"] == sweep_report.ERROR]
    for row in failed:  # a half-failed sweep is not a good one: a CI job must be able to tell
        click.echo(f"raytf: error: trial {row['point']} failed: {row.get('error') or 'see its result.json'}",
                   err=True)
    if failed:
        sys.exit(1)


# ---------------------------------------------------------------- the Ray Jobs API: submit, status, logs, stop
# Extra exit codes of these commands: 4 the job was stopped, 5 the Jobs API could not be reached or
# refused the token. `submit` and `logs --follow` exit with the job's own code (0, 1, 2, 3, 130).

_ALLOW_HTTP_TOKEN_HELP = ("Send the cluster token over plain http to an address other than this machine (by default "
                          "only https or http://127.0.0.1, the SSH port-forward, get it): only on a network you trust.")
_ADDRESS_HELP = ("The Ray Jobs API (the head's dashboard URL). Default: RAY_API_SERVER_ADDRESS, RAY_ADDRESS, "
                 "else http://127.0.0.1:8265 (where `ray dashboard cluster.yaml` forwards it).")


def _jobs_command(body) -> None:
    """Run a Jobs API command body; RaytfErrors become one line and their exit code."""
    with exit_on_error():
        code = body()
    sys.exit(code or 0)


def _follow_to_end(jobs, job_id: str) -> int:
    from raytf import submit as jobs_api

    try:
        info = jobs.follow(job_id, note=lambda text: click.echo(text, err=True))
    except KeyboardInterrupt:
        click.echo(f"raytf: stopped following; job {job_id} keeps running "
                   f"(`raytf stop {job_id} --address {jobs.address}` stops it)", err=True)
        return 130
    click.echo(jobs_api.describe(job_id, info), err=True)
    return jobs_api.exit_code(info)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--address", default=None, help=_ADDRESS_HELP)
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key, e.g. --set train.epochs=3 (repeatable); passed on to `raytf run`.")
@click.option("--no-wait", is_flag=True, help="Print the submission id and return at once.")
@click.option("--verbose", "-v", is_flag=True, help=_VERBOSE_HELP + " Passed on to `raytf run`.")
@click.option("--allow-http-token", is_flag=True, help=_ALLOW_HTTP_TOKEN_HELP)
@_stderr_filtered
def submit(job_file: str, address: str | None, settings: tuple[str, ...], no_wait: bool, verbose: bool,
           allow_http_token: bool) -> None:
    """Submit JOB_FILE to a Ray cluster through the Jobs API, follow its logs, exit with its status.

    The job file's folder is uploaded as the job's working directory, and the cluster runs
    `raytf run JOB_FILE` there. Ctrl-C stops following, not the job."""
    from raytf import submit as jobs_api
    from raytf.driver import packaging

    def body() -> int:
        sub = jobs_api.prepare(job_file, settings, verbose=verbose)  # a bad spec fails here, before any network
        if sub.left_out:
            click.echo(sub.left_out, err=True)
        jobs = jobs_api.Jobs(address, allow_http_token=allow_http_token)
        with packaging.ray_packaging_messages(verbose, note=lambda text: click.echo(text, err=True)):
            job_id = jobs.submit(sub)  # uploads the job folder: Ray's lines about it only with -v
        click.echo(f"raytf: submitted {job_id} to {jobs.address} (working directory {sub.job_dir})", err=True)
        click.echo(sub.results, err=True)
        if no_wait:
            click.echo(job_id)
            click.echo(f"raytf: follow with `raytf logs {job_id} --follow --address {jobs.address}`", err=True)
            return 0
        click.echo(f"raytf: following its logs; Ctrl-C stops following, "
                   f"`raytf stop {job_id} --address {jobs.address}` stops the job", err=True)
        return _follow_to_end(jobs, job_id)

    _jobs_command(body)


@main.command()
@click.argument("job_id")
@click.option("--address", default=None, help=_ADDRESS_HELP)
@click.option("--allow-http-token", is_flag=True, help=_ALLOW_HTTP_TOKEN_HELP)
@_stderr_filtered
def status(job_id: str, address: str | None, allow_http_token: bool) -> None:
    """Show a submitted job's status (and, if it failed, why)."""
    from raytf import submit as jobs_api

    def body() -> int:
        import time

        info = jobs_api.Jobs(address, allow_http_token=allow_http_token).info(job_id)
        click.echo(jobs_api.describe(job_id, info))
        click.echo(f"  entrypoint: {info.entrypoint}")
        if info.start_time:
            end = (info.end_time or time.time() * 1000) / 1000
            click.echo(f"  started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info.start_time / 1000))}, "
                       f"{'ran' if info.end_time else 'running for'} {end - info.start_time / 1000:.0f}s")
        where = (info.metadata or {}).get(jobs_api.OUTPUT_KEY)
        if where:  # the run's own state, from its storage
            from raytf import results as run_results

            try:
                click.echo("  run: " + run_results.describe(run_results.read(where), where))
            except RaytfError as exc:
                click.echo(f"  run: {exc}")
        return 0

    _jobs_command(body)


@main.command()
@click.argument("job_id")
@click.option("--address", default=None, help=_ADDRESS_HELP)
@click.option("--follow", "-f", is_flag=True, help="Follow the logs until the job ends; exit with its status.")
@click.option("--allow-http-token", is_flag=True, help=_ALLOW_HTTP_TOKEN_HELP)
@_stderr_filtered
def logs(job_id: str, address: str | None, follow: bool, allow_http_token: bool) -> None:
    """Print a submitted job's logs."""
    from raytf import submit as jobs_api

    def body() -> int:
        jobs = jobs_api.Jobs(address, allow_http_token=allow_http_token)
        if follow:
            return _follow_to_end(jobs, job_id)
        click.echo(jobs.logs(job_id), nl=False)
        return 0

    _jobs_command(body)


@main.command()
@click.argument("job_id")
@click.option("--address", default=None, help=_ADDRESS_HELP)
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, metavar="SECONDS",
              help="How long to wait for the job to end after the stop request.")
@click.option("--allow-http-token", is_flag=True, help=_ALLOW_HTTP_TOKEN_HELP)
@_stderr_filtered
def stop(job_id: str, address: str | None, timeout_s: float, allow_http_token: bool) -> None:
    """Stop a submitted job; Ray frees its actors and placement group when its driver ends."""
    from raytf import submit as jobs_api

    def body() -> int:
        info, stopped = jobs_api.Jobs(address, allow_http_token=allow_http_token).stop(job_id, timeout_s)
        if not stopped:
            click.echo(f"raytf: job {job_id} had already ended: {info.status}")
            return 0
        click.echo(jobs_api.describe(job_id, info))
        return 0

    _jobs_command(body)


@main.command()
@click.argument("run_name", metavar="RUN")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="With a job file: override a spec key (its output.dir, its name), as for `raytf run`.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result.json.")
@_stderr_filtered
def results(run_name: str, settings: tuple[str, ...], as_json: bool) -> None:
    """Show a run's results from its storage: RUN is its output.dir (a folder or a URI such as
    s3://bucket/runs/m), its job file, or its name (runs/<name> here). Exit 0 succeeded or running, 1 failed
    or interrupted, 2 no result there or not raytf's (a bad RUN, a result.json of other types), 5 the storage
    cannot be read (endpoint down, credentials refused)."""
    import json

    from raytf import results as run_results

    with exit_on_error():
        where = run_results.locate(run_name, settings)
        saved = run_results.read(where)
    click.echo(json.dumps(saved, indent=2) if as_json else run_results.describe(saved, where))
    sys.exit(run_results.exit_code(saved))


@main.command("k8s")
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--image", default=None, help=("Required: the image every Ray pod runs, with Ray, raytf, TensorFlow and "
                                             "the job folder at --workdir."))
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Override a spec key (repeatable); passed on to `raytf run` in the entrypoint.")
@click.option("--workdir", default="/app", show_default=True, help="The job folder's absolute path inside the image.")
@click.option("--queue", default=None, help="A Kueue LocalQueue: the RayJob waits in it until Kueue admits it.")
@click.option("--priority-class", default=None, metavar="NAME",
              help="A PriorityClass for every Ray pod (the scheduler's, and Kueue's, priority and preemption).")
@click.option("--token-secret", default=None, help=("A Secret with key auth_token for Ray's token auth (default: "
                                                    "KubeRay generates one)."))
@click.option("--storage-secret", default=None, help=("A Secret whose keys become the pods' environment: the "
                                                      "credentials output.dir's storage needs (e.g. AWS_ACCESS_KEY_ID, "
                                                      "AWS_SECRET_ACCESS_KEY)."))
@click.option("--worker-memory", default="8Gi", show_default=True, help="Memory of each worker pod.")
@click.option("--retries", default=2, show_default=True, type=click.IntRange(0, 100),
              help="RayJob backoffLimit: new clusters KubeRay may build after a failure; each resumes (--resume auto).")
@click.option("--start-deadline", default=1800, show_default=True, metavar="SECONDS",  # raytf.k8s.START_DEADLINE
              type=click.IntRange(0, 2**31 - 1),
              help=("preRunningDeadlineSeconds: an attempt whose cluster is not running this long after it started "
                    "fails (and is retried); 0: no deadline."))
@click.option("--keep-after-success", default=0, show_default=True, metavar="SECONDS",
              type=click.IntRange(0, 2**31 - 1),
              help="How long the cluster stays after the job succeeded (with --queue: after it ended).")
@click.option("--keep-after-failure", default=None, metavar="SECONDS", type=click.IntRange(0, 2**31 - 1),
              help=("After the last attempt failed, the workers go at once and the head stays this long, for its "
                    "logs and dashboard [default: 3600; not with --queue]."))  # raytf.k8s.KEEP_AFTER_FAILURE
@click.option("--output", "-o", "output_file", default="-", show_default=True, help="Where to write the manifest.")
@_stderr_filtered
def k8s(job_file: str, image: str | None, settings: tuple[str, ...], workdir: str, queue: str | None,
        priority_class: str | None, token_secret: str | None, storage_secret: str | None, worker_memory: str,
        retries: int, start_deadline: int, keep_after_success: int, keep_after_failure: int | None,
        output_file: str) -> None:
    """Write a KubeRay RayJob manifest (KubeRay 1.6.0 or later) for JOB_FILE: head and worker groups sized from
    the spec, token auth, `raytf run JOB_FILE --resume auto` as the entrypoint, the cluster deleted after the job.
    output.dir must be a URI (a retry builds a new cluster). No Ray, no Kubernetes client: apply it with
    `kubectl apply -f`."""
    from pathlib import Path

    import yaml

    from raytf import job as job_lib
    from raytf import k8s as manifests

    with exit_on_error():
        if output_file != "-" and (problem := manifests.output_file_problem(output_file, job_file)):
            raise SpecError(problem)
        path = Path(job_file).expanduser().resolve()
        job = job_lib.read_job(job_file, settings)
        try:
            inside = path.relative_to(job.job_dir).as_posix()
        except ValueError:
            raise SpecError(f"{job_file}: the job file must be inside its job folder {job.job_dir} (the image holds "
                            f"that folder at --workdir)") from None
        manifest = manifests.rayjob(job, inside, image=image, settings=settings, queue=queue,
                                    priority_class=priority_class, token_secret=token_secret,
                                    storage_secret=storage_secret, workdir=workdir, worker_memory=worker_memory,
                                    backoff_limit=retries, start_deadline=start_deadline,
                                    keep_after_success=keep_after_success, keep_after_failure=keep_after_failure)
        text = yaml.dump(manifest, Dumper=manifests.PlainDumper, sort_keys=False, width=10_000)  # no folded lines
        if output_file == "-":
            click.echo(text, nl=False)
            return
        try:
            Path(output_file).expanduser().write_text(text)
        except OSError as exc:
            raise SpecError(f"-o {output_file}: cannot write it ({exc.strerror or exc}); write elsewhere") from None
    click.echo(f"raytf: wrote {output_file}; `kubectl apply -f {output_file}` runs it", err=True)


@main.command()
@click.option("--indent", default=2, show_default=True, type=click.IntRange(0, 8), help="Spaces per JSON level.")
def schema(indent: int) -> None:
    """Print the JSON Schema of a job file (a sweep file's tune: section included), made from the spec's models.

    Editors complete and check job files with it, e.g. `raytf schema > raytf-job.schema.json` and a first line
    `# yaml-language-server: $schema=raytf-job.schema.json` in the job file. No Ray, no TensorFlow."""
    import json

    from raytf.spec_reference import job_schema

    click.echo(json.dumps(job_schema(), indent=indent or None))


@main.command("spot-watch")
@click.option("--interval", default=5.0, show_default=True, help="Seconds between looks at the instance metadata.")
@click.option("--imds", default="http://169.254.169.254", show_default=True, help="The instance metadata service.")
@_stderr_filtered
def spot_watch(interval: float, imds: str) -> None:
    """On an EC2 Spot node: drain this Ray node when AWS announces its interruption (cluster.yaml starts it),
    so raytf jobs checkpoint before the node goes."""
    from raytf import spot_watch as watcher

    with exit_on_error("raytf spot-watch: stopped"):
        watcher.watch(imds, interval, log=lambda line: click.echo(line, err=True))


if __name__ == "__main__":
    main()
