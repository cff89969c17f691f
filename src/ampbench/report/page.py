"""report.html: report.md as one self-contained page, for MLflow's artifact view and a browser.

MLflow shows an HTML artifact inline in a sandboxed iframe, where a relative path to a sibling artifact does not
resolve; so every figure is embedded as a data URI and the stylesheet is inline: the page loads nothing.
"""

from __future__ import annotations

import base64
import html
import mimetypes
import re
from pathlib import Path

import markdown

STYLE = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; max-width: 1100px;
       margin: 2em auto; padding: 0 1.5em; }
h1 { font-size: 1.7em; border-bottom: 1px solid #d0d7de; padding-bottom: .3em; }
h2 { font-size: 1.3em; border-bottom: 1px solid #d8dee4; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 13px; display: block; overflow-x: auto; }
th, td { border: 1px solid #d0d7de; padding: 4px 9px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
tr:nth-child(even) td { background: #fbfcfd; }
code { background: #f3f4f6; padding: .1em .3em; border-radius: 4px; font-size: 90%; }
pre { background: #f6f8fa; padding: 1em; overflow-x: auto; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; }
"""

_IMG = re.compile(r'(<img\b[^>]*?\bsrc=")([^"]+)("[^>]*>)')


def _data_uri(path: Path) -> str:
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def _converter() -> markdown.Markdown:
    """Markdown with tables and fenced code, and no raw HTML: text such as an error's ``<lambda>`` or ``a<b`` is
    shown as written, never read as a tag."""
    md = markdown.Markdown(extensions=["tables", "fenced_code"], output_format="html")
    md.preprocessors.deregister("html_block")
    md.inlinePatterns.deregister("html")
    return md


def render(md_text: str, base_dir: Path) -> str:
    """The page: ``md_text`` as HTML, each image found under ``base_dir`` (report.md's folder) embedded; an image
    that is not there is left out, its alt text in its place, never linked."""
    body = _converter().convert(md_text)

    def embed(m: re.Match) -> str:
        src = html.unescape(m.group(2))
        path = (base_dir / src).resolve()
        if src.startswith(("data:", "http:", "https:", "//")) or not path.is_file():
            alt = re.search(r'\balt="([^"]*)"', m.group(0))
            return f"<em>[{alt.group(1) if alt else 'figure'}: not found]</em>"
        return f"{m.group(1)}{_data_uri(path)}{m.group(3)}"

    body = _IMG.sub(embed, body)
    first = re.search(r"^#\s+(.+)$", md_text, re.MULTILINE)
    title = html.escape(first.group(1) if first else "ampbench report")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{title}</title>\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<style>{STYLE}</style>\n'
            f"</head>\n<body>\n{body}\n</body>\n</html>\n")
