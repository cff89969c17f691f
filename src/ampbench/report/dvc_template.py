"""The page `dvc plots show` fills, with vega, vega-lite and vega-embed inline: plots that draw with no network.

    python -m ampbench.report.dvc_template .dvc/plots.html   # what `make install` runs

DVC's own page loads the three libraries from a CDN, so on a node without internet it stays blank. DVC takes a
page of our own instead (``[plots] html_template = plots.html``, a path relative to ``.dvc/``); this one carries
the pinned vl-convert-python's JavaScript bundle in a ``<script>``. It is generated, not committed: 900 KB of
someone else's minified code, made again from the pinned package at install. The bundle is Vega-Lite 6 and DVC's
specs name v5: every plot draws (checked in headless Chromium, network off); vega-embed notes the difference in
the browser's console. The setting goes where the page is made, in that checkout's ``.dvc/config.local``
(`make install`) or a sandbox's own config: DVC takes a missing template's path as its text and stops ("HTML
template has to contain '{plot_divs}'"), so a checkout without the page keeps DVC's default one.
"""

from __future__ import annotations

import sys
from pathlib import Path

NAME = "plots.html"  # under .dvc/: what plots.html_template names (DVC resolves it from .dvc/)

# dvc_render's PAGE_HTML less its {scripts} (the CDN tags); DVC replaces {refresh_tag} and {plot_divs} by plain
# text substitution, and each plot's div calls vegaEmbed as it is parsed, so the bundle comes first, in <head>.
PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <title>DVC Plot</title>
    <meta charset="utf-8">
    <script type="text/javascript">
// vega, vega-lite and vega-embed: vl-convert-python %(version)s's javascript_bundle(), run in a function of its own
// so that its top-level names cannot clash with the `var spec` of each plot's div
(function () {
%(bundle)s
}).call(window);
    </script>
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""

# text in the bundle that would end the <script> early, or that DVC would replace (its CDN tags, the plots)
UNSAFE = ("</script", "<!--", "{scripts}", "{plot_divs}", "{refresh_tag}")


def page() -> str:
    """The template's text: DVC's page with the bundle inline."""
    import vl_convert  # imported here: only install and the sandbox make the page

    bundle = vl_convert.javascript_bundle()
    found = [s for s in UNSAFE if s in bundle.lower()]
    if found:
        raise RuntimeError(f"vl-convert-python {vl_convert.__version__}'s bundle holds {found}, which would break "
                           "the page; pin the version in requirements.txt (1.9.0.post1 has none)")
    return PAGE % {"version": vl_convert.__version__, "bundle": bundle}


def write(path: Path) -> Path:
    """Write the template to ``path`` (its folder made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(), encoding="utf8")
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m {__spec__.name} PATH   (e.g. .dvc/{NAME})", file=sys.stderr)
        return 2
    print(f"wrote {write(Path(argv[0]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
