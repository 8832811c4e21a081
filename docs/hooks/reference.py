"""MkDocs hook: the pages that are generated at build time, so that they cannot drift from the code.

- ``reference/cli.md``: every command and option of ``evomerge``, read from the argparse parsers
  (``evomerge.cli.build_parser``), with each option's help and its stated default;
- ``reference/policy.md``: every field of a merge policy, read from the pydantic model
  (``evomerge.policy.json_schema``, ``field_specs`` and ``ADDED_IN``): type, range or choices, default, the
  schema version that added it, and its description;
- ``results.md``: ``benchmarks/RESULTS.md``, the measured figures, kept beside the benchmarks that produce them.

Links are written between the files as they lie in the repository (``../benchmarks/RESULTS.md`` from a page of
``docs/``; ``../evomerge/cli.py`` and ``../evomerge/policy.py`` for the references, the code they are read from),
so that they also work on disk and on a code host; ``on_page_markdown`` points them at the site's pages. Nothing generated is committed; ``mkdocs build`` alone writes it. Named in ``mkdocs.yml``
(``hooks:``); ``exclude_docs`` keeps this folder out of the site.
"""

from __future__ import annotations

import argparse
import json
import posixpath
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the checkout's evomerge, also when it is not installed
    sys.path.insert(0, str(ROOT))

RESULTS = "benchmarks/RESULTS.md"
GENERATED = {"reference/cli.md", "reference/policy.md", "results.md"}
#: what each generated page is made from, as it lies in the repository: the pages of docs/ link these (a link that
#: works on disk and on a code host), and the site points them at the generated page
SOURCES = {RESULTS: "results.md", "evomerge/cli.py": "reference/cli.md", "evomerge/policy.py": "reference/policy.md"}


# -- the command line -----------------------------------------------------------------------------------------
def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def _cell(text: str) -> str:
    """Text for a Markdown table cell: no pipes, no raw HTML, no stray emphasis (code spans kept as written)."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = (parts[i].replace("\\", "\\\\").replace("<", "&lt;").replace(">", "&gt;")
                    .replace("*", "\\*").replace("_", "\\_").replace("|", "\\|"))
    return "`".join(parts)


_DEFAULT = re.compile(r"\s*\(default: (.*)\)\s*$", re.S)


def split_default(action: argparse.Action) -> tuple[str, str]:
    """(help without its default, the default as the help states it)."""
    help_text = " ".join((action.help or "").split())
    m = _DEFAULT.search(help_text)
    if m:
        return help_text[:m.start()], m.group(1)
    if action.required or not action.option_strings:
        return help_text.removesuffix("; required"), "required"
    if isinstance(action, argparse._StoreTrueAction):
        return help_text, "off"
    return help_text, "-"


def _usage(p: argparse.ArgumentParser) -> str:
    return " ".join(p.format_usage().removeprefix("usage: ").split())


def cli_page() -> str:
    from evomerge import cli

    top = cli.build_parser()
    out = ["# Command-line reference", "",
           "Generated from the argparse parsers of `evomerge/cli.py` when the site is built: every command and every "
           "option, with its help and the default it states. `evomerge COMMAND --help` prints the same.", "",
           "```text", top.format_help().rstrip(), "```", ""]
    for path, p in cli.commands(top):
        name = " ".join(path)
        out += [f"## `evomerge {name}`", "", p.description or "", "", "```text", _usage(p), "```", ""]
        opts = options(p)
        if opts:
            out += ["| option | value | default | help |", "|---|---|---|---|"]
            for a in opts:
                flags = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}`"
                if a.choices:
                    value = " \\| ".join(f"`{c}`" for c in a.choices)
                elif a.nargs == 0:
                    value = ""
                else:
                    value = f"`{a.metavar or (a.dest.upper() if a.option_strings else a.dest)}`"
                help_text, default = split_default(a)
                if isinstance(a, argparse._AppendAction):
                    help_text += " (may be repeated)"
                out.append(f"| {flags} | {value} | {_cell(default)} | {_cell(help_text)} |")
            out.append("")
        if p.epilog:
            out += ["```text", p.epilog.rstrip(), "```", ""]
    return "\n".join(out)


# -- the policy fields ----------------------------------------------------------------------------------------
def _json(value) -> str:
    return json.dumps(value)


def policy_page() -> str:
    from evomerge import policy

    schema = policy.json_schema()
    specs = policy.field_specs()
    since = {f: v for v, fields in policy.ADDED_IN.items() for f in fields}
    out = ["# Policy-field reference", "",
           f"Generated from the pydantic model `evomerge.MergePolicy` (`evomerge/policy.py`) when the site is built: "
           f"every field of a policy file, schema version {policy.SCHEMA_VERSION}. Every field has a default, so a "
           "file lists only what it changes; unknown keys are refused. `evomerge policy schema` prints the same "
           "model as JSON Schema, and [Policies](../policies.md) explains the fields by topic.", "",
           "| field | type | range or choices | default | since |", "|---|---|---|---|---|"]
    rows, sections = [], []
    for name, prop in schema["properties"].items():
        spec = specs.get(name, {})
        if "enum" in prop:
            kind = "choice"
            values = ", ".join(f"`{c}`" for c in prop["enum"])
        else:
            kind = {"number": "float", "integer": "int", "string": "string", "boolean": "bool"}.get(
                prop.get("type"), str(prop.get("type", prop.get("const", "-"))))
            if "const" in prop:
                values = f"`{_json(prop['const'])}`"
            else:
                low = prop.get("minimum", prop.get("exclusiveMinimum"))
                high = prop.get("maximum", prop.get("exclusiveMaximum"))
                if low is None and high is None:
                    values = "-"
                else:
                    left = "(" if "exclusiveMinimum" in prop or spec.get("low_open") else "["
                    right = ")" if "exclusiveMaximum" in prop else "]"
                    values = f"{left}{'-inf' if low is None else _json(low)}, {'inf' if high is None else _json(high)}{right}"
        default = f"`{_json(prop['default'])}`" if "default" in prop else "required"
        version = since.get(name, 1)
        rows.append(f"| [`{name}`](#{name}) | {kind} | {values} | {default} | {version} |")
        sections += [f"## `{name}` {{ #{name} }}", "",
                     f"**{kind}**, {values if values != '-' else 'any'}; default {default}; schema {version}.", "",
                     prop.get("description", ""), ""]
    return "\n".join(out + rows + [""] + sections)


# -- MkDocs events --------------------------------------------------------------------------------------------
def on_files(files, config):
    from mkdocs.structure.files import File

    pages = {"reference/cli.md": cli_page(), "reference/policy.md": policy_page(),
             "results.md": (ROOT / RESULTS).read_text(encoding="utf-8")}
    for src_uri, content in pages.items():
        if files.get_file_from_path(src_uri) is not None:
            raise RuntimeError(f"docs/{src_uri} is generated at build time; remove the file from docs/")
        files.append(File.generated(config, src_uri, content=content))
    return files


_LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def _on_disk(src_uri: str) -> str:
    """Where a page of the site lies in the repository."""
    return RESULTS if src_uri == "results.md" else "docs/" + src_uri


def _in_site(path: str) -> str | None:
    """The site page of a repository file, if it has one."""
    if path in SOURCES:
        return SOURCES[path]
    return path.removeprefix("docs/") if path.startswith("docs/") else None


def on_page_markdown(markdown, page, config, files):
    """Links are written between the files as they lie in the repository (so they work on disk and on a code
    host); point them at the site's pages: docs/X is X, and a generated page's source is that page (:data:`SOURCES`).
    A link to anything else outside docs/ is left as it is, and MkDocs reports it."""
    here = posixpath.dirname(_on_disk(page.file.src_uri))
    site_here = posixpath.dirname(page.file.src_uri) or "."

    def repoint(m: re.Match) -> str:
        target = m.group("target")
        if "://" in target or target.startswith(("/", "mailto:")):
            return m.group(0)
        site = _in_site(posixpath.normpath(posixpath.join(here, target)))
        if site is None:
            return m.group(0)
        return f"]({posixpath.relpath(site, site_here)}{m.group('anchor') or ''})"

    return _LINK.sub(repoint, markdown)


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):(?=<code>)")


def on_page_content(html, page, config, files):
    """Docstrings name objects with Sphinx roles (:class:`Study`); show the name alone."""
    return _ROLE.sub("", html)
