#!/usr/bin/python3
"""The docs keep up with the code (ctest: docs_settings).

Checks, each against what the tree and the binaries say at test time, never a list kept here:
  - the settings table in docs/operations.md (between the settings markers) is exactly what
    settings_doc prints from the X-macro that also drives `embps-server --help`;
  - every flag `embps-server --help` prints appears in README.md or docs/ as `--flag` (and, with
    EMBPS_CLI_BIN, every option and command of the embps CLI);
  - every EMBPS_* variable the server, the C client and CLI, the Python library or the container
    entrypoint reads (found by scanning their sources), and every variable `--help` prints,
    appears there too;
  - `--help` prints no empty "(default )";
  - README.md names tests/run.sh (CI runs the README's test command), the user docs never send
    readers to ../shared/, and every relative link in them resolves.

Usage: check_docs.py            check (exit 1 with every problem listed)
       check_docs.py --write    rewrite the settings block of docs/operations.md, then check
Environment: EMBPS_SERVER_BIN (embps-server), EMBPS_SETTINGS_DOC_BIN (settings_doc), and
optionally EMBPS_CLI_BIN (embps): then every option and command of `embps --help` and of each
`embps COMMAND --help` must appear in the docs too.
"""
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPERATIONS = os.path.join(ROOT, "docs", "operations.md")
BEGIN = ("<!-- settings: begin. Generated from server/settings.h by "
         "`cmake --build build --target docs-settings`; do not edit by hand. -->")
END = "<!-- settings: end -->"


def run(argv):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr}")
    return out.stdout


def doc_files():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def split_block(text):
    """(before, block, after) of the settings block, or None when the markers are missing."""
    b, e = text.find(BEGIN), text.find(END)
    if b < 0 or e < b:
        return None
    b += len(BEGIN)
    return text[:b], text[b:e], text[e:]


def source_files(sub, exts):
    for dirpath, _, names in os.walk(os.path.join(ROOT, sub)):
        if "__pycache__" in dirpath:
            continue
        for n in names:
            if n.endswith(exts):
                yield os.path.join(dirpath, n)


def env_reads():
    """{variable: first source that reads it}, by where each kind of source names them."""
    found = {}

    def scan(paths, patterns):
        hits = 0
        for p in paths:
            text = read(p)
            for pat in patterns:
                for name in re.findall(pat, text):
                    found.setdefault(name, os.path.relpath(p, ROOT))
                    hits += 1
        return hits

    c_src = [p for d in ("server", "client", "common") for p in source_files(d, (".c", ".h"))]
    # getenv("EMBPS_X"), and a string literal that is exactly a variable's name (the CLI's
    # option table names its variables so and calls getenv on the table).
    c_hits = scan(c_src, [r'getenv\(\s*"(EMBPS_[A-Z0-9_]+)"', r'"(EMBPS_[A-Z0-9_]+)"'])
    py_hits = scan(source_files(os.path.join("python", "embps"), (".py",)),
                   [r'os\.environ(?:\.get)?[\[(]\s*"(EMBPS_[A-Z0-9_]+)"',
                    r'os\.getenv\(\s*"(EMBPS_[A-Z0-9_]+)"'])
    sh_hits = scan([os.path.join(ROOT, "deploy", "entrypoint.sh")],
                   [r'\$\{?(EMBPS_[A-Z0-9_]+)'])
    # A scan that finds nothing has gone stale (code moved, a new idiom): say so, not pass.
    for what, hits in (("the C sources", c_hits), ("the Python library", py_hits),
                       ("deploy/entrypoint.sh", sh_hits)):
        if not hits:
            raise SystemExit(f"check_docs.py found no EMBPS_* variable read in {what}: its "
                             "pattern no longer matches how the code reads them; update it")
    return found


def flag_documented(flag, text):
    return re.search(r"--" + re.escape(flag) + r"(?![a-z0-9-])", text) is not None


def cli_problems(cli, everything):
    """Every option of `embps --help` and of `embps COMMAND --help` for every command it lists
    must appear in the docs."""
    problems = []
    top = run([cli, "--help"])
    commands = re.findall(r"^  ([a-z][a-z-]*)\s", top.split("commands:", 1)[-1], re.M)
    if "commands:" not in top or not commands:
        return ["`embps --help` lists no commands: its format changed?"]
    helps = [("embps --help", top)]
    helps += [(f"embps {c} --help", run([cli, c, "--help"])) for c in commands]
    for where, text in helps:
        for f in re.findall(r"^\s+--([a-z0-9][a-z0-9-]*)", text, re.M):
            if not flag_documented(f, everything):
                problems.append(f"option --{f} ({where}) appears nowhere in README.md or docs/")
    for c in commands:
        if not re.search(r"\bembps\b[^\n]*\s" + re.escape(c) + r"\b", everything):
            problems.append(f"command `embps {c}` appears nowhere in README.md or docs/")
    return problems


def main():
    server = os.environ.get("EMBPS_SERVER_BIN")
    gen = os.environ.get("EMBPS_SETTINGS_DOC_BIN")
    if not server or not gen:
        raise SystemExit("set EMBPS_SERVER_BIN and EMBPS_SETTINGS_DOC_BIN (ctest does)")
    table = run([gen])
    help_text = run([server, "--help"])
    problems = []

    ops = read(OPERATIONS)
    parts = split_block(ops)
    if parts is None:
        raise SystemExit(f"{OPERATIONS} lacks the settings markers:\n{BEGIN}\n{END}")
    want = "\n" + table
    if "--write" in sys.argv[1:] and parts[1] != want:
        with open(OPERATIONS, "w", encoding="utf-8") as f:
            f.write(parts[0] + want + parts[2])
        print(f"rewrote the settings table in {os.path.relpath(OPERATIONS, ROOT)}")
    elif parts[1] != want:
        problems.append("the settings table in docs/operations.md is not what server/settings.h "
                        "declares: run `cmake --build build --target docs-settings` and commit it")

    docs = {p: read(p) for p in doc_files()}
    everything = "\n".join(docs.values())

    flags = re.findall(r"^\s+--([a-z0-9][a-z0-9-]*)", help_text, re.M)
    if len(flags) < 2:
        problems.append(f"`embps-server --help` listed {len(flags)} flags: its format changed?")
    for f in flags:
        if not flag_documented(f, everything):
            problems.append(f"flag --{f} (embps-server --help) appears nowhere in README.md or "
                            "docs/")

    cli = os.environ.get("EMBPS_CLI_BIN")
    if cli:
        problems += cli_problems(cli, everything)

    variables = {v: "embps-server --help" for v in re.findall(r"env (EMBPS_[A-Z0-9_]+)", help_text)}
    for v, where in env_reads().items():
        variables.setdefault(v, where)
    for v, where in sorted(variables.items()):
        if not re.search(re.escape(v) + r"(?![A-Z0-9_])", everything):
            problems.append(f"variable {v} (read in {where}) appears nowhere in README.md or docs/")

    if re.search(r"\(default \)", help_text):
        problems.append("`embps-server --help` prints an empty '(default )'")

    readme = docs[os.path.join(ROOT, "README.md")]
    if "tests/run.sh" not in readme:
        problems.append("README.md does not name tests/run.sh, the test command CI runs")
    for p, text in docs.items():
        rel = os.path.relpath(p, ROOT)
        if "../shared" in text or "shared/DESIGN" in text:
            problems.append(f"{rel} sends readers to ../shared/, which users of the project lack")
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            target = link.split("#", 1)[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(p), target))):
                problems.append(f"{rel} links to {link}, which does not exist")

    for p in problems:
        print("FAIL:", p)
    if problems:
        return 1
    print(f"docs ok: {len(flags)} flags, {len(variables)} variables, settings table current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
