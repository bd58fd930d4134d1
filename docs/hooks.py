"""mkdocs hook: the job-spec reference's key tables, made from raytf.spec's pydantic models at build time
(raytf/spec_reference.py), so the page cannot drift from the code."""
from raytf.spec_reference import reference_markdown

MARKER = "<!-- raytf:spec-reference -->"
PAGE = "reference/job-spec.md"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE}: the marker {MARKER} is missing; the generated tables go there")
    return markdown.replace(MARKER, reference_markdown(level=3))  # under the page's "Keys"
