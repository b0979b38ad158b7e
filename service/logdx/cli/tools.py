"""Maintenance commands: `logdx rules test`, `logdx prompts check`, `logdx model convert`,
`logdx synth`."""

from __future__ import annotations

import argparse
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from logdx.faces import EXIT_FAILED, EXIT_OK, UsageError, add_config_arg, settings_from

if TYPE_CHECKING:
    from logdx.diagnose.rules import RuleHit


def add_tool_parsers(sub: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser]) -> None:
    rules = sub.add_parser("rules", help="work with rule packs")
    rules_sub = rules.add_subparsers(dest="rules_command", parser_class=parser_class, metavar="SUBCOMMAND",
                                     required=True)
    rt = rules_sub.add_parser("test", help="load all packs, check every rule against its examples and run the "
                                           "packs' raw-input tests (tests: in a pack)")
    rt.add_argument("dirs", nargs="*", type=Path, help="extra rule pack folders")
    rt.add_argument("--rules", action="append", type=Path, default=[], metavar="DIR",
                    help="extra rule pack folder (repeatable; the same as naming it)")
    rt.set_defaults(func=cmd_rules_test)
    rd = rules_sub.add_parser("draft", help="draft a candidate rule pack for a job's root line that no rule names",
                              description="Diagnose the job (rules and catalog only) and, when its root line was "
                              "decided by a generic fallback, the catalog or no rule, write a candidate pack: a "
                              "pattern from the line's Drain template, a proposed label, the job's raw lines as "
                              "examples and as the pack's test. The pattern is checked against generated healthy "
                              "runs and the rules' counterexamples first (tightened, or dropped, if it hits one).")
    rd.add_argument("log", type=Path, metavar="JOB.log", help="the job's log (.gz is read transparently)")
    rd.add_argument("--out", type=Path, default=Path("rules-draft"), metavar="DIR",
                    help="where to write the pack (default: ./rules-draft)")
    rd.add_argument("--rules", action="append", type=Path, default=[], metavar="DIR",
                    help="extra rule pack folder (repeatable)")
    rd.add_argument("--exit-code", type=int, metavar="N", help="how the job ended, when you know it (as diagnose "
                    "--exit-code): a log whose last error is a plain line, not an exception, fails with a non-zero one")
    add_config_arg(rd)
    rd.set_defaults(func=cmd_rules_draft)
    ra = rules_sub.add_parser("approve", help="check a drafted pack and copy it into your rules folder",
                              description="Load the drafted pack with the real loader, run its examples and "
                              "raw-input tests (as `rules test`), then copy it without its `# proposed:` marks "
                              "into --into DIR, or the first of the settings' rules.dirs.")
    ra.add_argument("draft", type=Path, metavar="DRAFT.yaml")
    ra.add_argument("--into", type=Path, metavar="DIR", help="the rules folder (default: the first rules.dirs)")
    add_config_arg(ra)
    ra.set_defaults(func=cmd_rules_approve)
    rx = rules_sub.add_parser("explain", help="what logdx makes of raw lines: the record, events, rules, and why "
                                              "a rule did not match", description="Explain raw log lines: what the "
                              "normaliser made of each (rank, host, stream, timestamp, text), which events, rules and "
                              "catalog entries fired on it, why rules that nearly matched (or --rule) did not; the "
                              "job-level verdict last.")
    rx.add_argument("lines", nargs="*", metavar="LINE", help="raw lines (launcher prefixes and all)")
    rx.add_argument("--file", "-f", metavar="PATH", help="a raw log (- for stdin; .gz is read transparently)")
    rx.add_argument("--rule", action="append", default=[], metavar="ID", help="explain this rule on every line "
                    "it does not hit (repeatable)")
    rx.add_argument("--all", action="store_true", help="every line, also those nothing happened on (the default "
                    "for up to 200 lines)")
    rx.add_argument("--verbose", "-v", action="store_true", help="also why each rule whose words occur in a line "
                    "did not match it (default: only for --rule)")
    rx.add_argument("--rules", action="append", type=Path, default=[], metavar="DIR",
                    help="extra rule pack folder (repeatable)")
    add_config_arg(rx)
    rx.set_defaults(func=cmd_rules_explain)

    md = sub.add_parser("model", help="the embedded LLM")
    md_sub = md.add_subparsers(dest="model_command", parser_class=parser_class, metavar="SUBCOMMAND", required=True)
    mc = md_sub.add_parser("convert", help="convert the packaged GGUF once into the cache (make install does; seconds)")
    mc.add_argument("dir", nargs="?", type=Path, help="target folder (default: llm.cache_dir/gemma3-270m)")
    add_config_arg(mc)
    mc.set_defaults(func=cmd_model_convert)

    pr = sub.add_parser("prompts", help="the LLM prompt templates")
    pr_sub = pr.add_subparsers(dest="prompts_command", parser_class=parser_class, metavar="SUBCOMMAND", required=True)
    pc = pr_sub.add_parser("check", help="compile every template and render each with sample data; "
                                         "errors name file and line")
    pc.add_argument("dir", nargs="?", type=Path)
    add_config_arg(pc)
    pc.set_defaults(func=cmd_prompts_check)

    tk = sub.add_parser("token", help="credentials for the HTTP API")
    tk_sub = tk.add_subparsers(dest="token_command", parser_class=parser_class, metavar="SUBCOMMAND", required=True)
    tn = tk_sub.add_parser("node", help="each node's own token (derived from server.node_key): it speaks for that "
                                        "node only", description="Print one line per node: HOST TOKEN. Give each node "
                           "its token only (a Slurm prolog, the node's image, a per-node Secret); the server keeps the "
                           "key alone.")
    tn.add_argument("hosts", nargs="+", metavar="HOST", help="plain host names, or Slurm hostlists (gpu-node-[01-64])")
    add_config_arg(tn)
    tn.set_defaults(func=cmd_token_node)
    td = tk_sub.add_parser("digest", help="what server.tokens[].sha256 holds for a token (read from stdin)")
    td.set_defaults(func=cmd_token_digest)

    from logdx.synth.cli import build_parser as synth_parser

    sy = sub.add_parser("synth", parents=[synth_parser(add_help=False)], help="generate a realistic multi-rank "
                        "training log", description="Write a realistic, deterministic log of a multi-rank training job.")
    sy.set_defaults(func=cmd_synth)


def cmd_token_node(args: argparse.Namespace) -> int:
    from logdx.credentials import derive
    from logdx.hosts import HostScope, HostScopeError

    key = settings_from(args).server.node_key
    if not key:
        raise UsageError("server.node_key is not set (LOGDX_SERVER__NODE_KEY, or server.node_key in the config file)")
    try:
        scope = HostScope.parse(args.hosts)
    except HostScopeError as e:
        raise UsageError(str(e)) from None
    if scope.is_everywhere:
        raise UsageError("'*' is no node: name the nodes")
    for host in scope.hosts():
        print(host, derive(key, host))
    return EXIT_OK


def cmd_token_digest(args: argparse.Namespace) -> int:
    import hashlib
    import sys

    token = sys.stdin.readline().strip()
    if not token:
        raise UsageError("no token on stdin")
    print(hashlib.sha256(token.encode()).hexdigest())
    return EXIT_OK


def cmd_rules_test(args: argparse.Namespace) -> int:
    from logdx.diagnose.rules import RuleError, check_examples, default_rules_dir, load_rules, precedence_problems

    dirs = [default_rules_dir(), *args.dirs, *args.rules]
    try:
        ruleset = load_rules(dirs, verify=False)
    except RuleError as e:
        raise UsageError(str(e)) from None
    from logdx.config import Settings
    from logdx.explain import run_pack_tests, run_timeline_tests

    problems = check_examples(ruleset)
    test_hits: list[tuple[str, Sequence[RuleHit]]] = []
    problems += run_pack_tests(Settings(), ruleset, test_hits)
    # two root causes of different types on one example, neither refining the other: which wins is a choice
    problems += precedence_problems(ruleset, test_hits)
    problems += run_timeline_tests(Settings(), ruleset)  # timeline.yaml's own raw-input tests
    for p in problems:
        print(p)
    verdict = "ok" if not problems else f"{len(problems)} problem(s)"
    print(f"{len(ruleset.rules)} rules in {len(dirs)} folder(s), {len(ruleset.tests)} raw-input tests: {verdict}")
    return EXIT_OK if not problems else EXIT_FAILED


def cmd_rules_draft(args: argparse.Namespace) -> int:
    from logdx.ruledraft import DraftError, draft, pack_problems, write_draft

    if not args.log.is_file():
        raise UsageError(f"rules draft: {args.log}: no such file")
    for d in args.rules:
        if not d.is_dir():
            raise UsageError(f"--rules {d}: not a directory")
    settings = settings_from(args)
    try:
        drafted = draft(args.log, settings, args.rules, exit_code=args.exit_code)
        path = write_draft(drafted, args.out)
    except DraftError as e:
        raise UsageError(f"rules draft: {e}") from None
    except OSError as e:
        raise UsageError(f"rules draft: {args.out}: cannot write ({e})") from None
    for r in drafted.rules:
        lab = r.label
        print(f"rule {r.id}: {r.pattern}")
        print(f"  proposed {lab.category.value} / {lab.failure_type} / {lab.action.value}, from {r.basis}")
    for note in drafted.notes:
        print(f"  {note}")
    print(f"  checked against {drafted.checked}: no hit")
    problems = pack_problems(path, settings)
    if problems:  # a draft the loader or its own test refuses is written for editing, and said so
        for p in problems:
            print(p)
        print(f"wrote {path}, but it does not pass `logdx rules test` ({len(problems)} problem(s)): edit it")
        return EXIT_FAILED
    print(f"wrote {path}: check it with `logdx rules test --rules {path.parent}`, then `logdx rules approve {path}`")
    return EXIT_OK


def cmd_rules_approve(args: argparse.Namespace) -> int:
    from logdx.ruledraft import DraftError, approve

    try:
        target = approve(args.draft, settings_from(args), args.into)
    except DraftError as e:
        raise UsageError(f"rules approve: {e}") from None
    except OSError as e:
        raise UsageError(f"rules approve: cannot write ({e})") from None
    print(f"approved: {target} (loads with the other packs of {target.parent})")
    return EXIT_OK


_EVERY_LINE_UP_TO = 200  # a longer input shows only the lines something happened on (unless --all)


def cmd_rules_explain(args: argparse.Namespace) -> int:
    from logdx.diagnose.rules import RuleError, default_rules_dir, load_rules
    from logdx.explain import explain_lines, render_explanation
    from logdx.normalize import InputError, iter_lines, open_input
    from logdx.pipeline import Engine

    if bool(args.lines) == bool(args.file):
        raise UsageError("rules explain: give raw lines as arguments, or --file PATH (- for stdin), not both")
    settings = settings_from(args)
    for d in args.rules:
        if not d.is_dir():
            raise UsageError(f"--rules {d}: not a directory")
    try:
        rules = load_rules([default_rules_dir(), *settings.rules.dirs, *args.rules])
    except RuleError as e:
        raise UsageError(str(e)) from None
    unknown = [r for r in args.rule if r not in rules.by_id]
    if unknown:
        raise UsageError(f"--rule {unknown[0]}: no such rule (logdx rules test lists the packs)")
    engine = Engine.for_rules(settings, rules)
    limit = None if args.all else _EVERY_LINE_UP_TO
    if args.file:
        try:
            with open_input(args.file) as f:
                ex = explain_lines(engine, iter_lines(f, settings.input.max_line_bytes), args.rule,
                                   settings.catalog.enabled, limit)
        except InputError as e:
            raise UsageError(f"rules explain: {e}") from None
        except (EOFError, OSError, zlib.error) as e:  # a truncated or corrupt .gz
            raise UsageError(f"rules explain: {args.file}: cannot read ({e})") from None
    else:
        ex = explain_lines(engine, [line for arg in args.lines for line in arg.split("\n")], args.rule,
                           settings.catalog.enabled, limit)
    if not ex.lines and ex.report.status == "empty":
        raise UsageError("rules explain: no lines to explain")
    print(render_explanation(ex, verbose=args.verbose, asked=args.rule))
    return EXIT_OK


def cmd_model_convert(args: argparse.Namespace) -> int:
    from logdx.diagnose.llm import ensure_converted, model_dir

    target = args.dir or model_dir(settings_from(args).llm)
    info = ensure_converted(Path(target))
    done = f"converted in {info.seconds:.1f} s" if info.converted else "already converted"
    print(f"{info.cache_dir}: {done}")
    return EXIT_OK


def cmd_prompts_check(args: argparse.Namespace) -> int:
    from logdx.diagnose.llm import PromptError, Prompts
    from logdx.diagnose.llm.check import check_prompts

    try:
        prompts = Prompts(args.dir or settings_from(args).llm.prompts_dir)
    except PromptError as e:
        raise UsageError(str(e)) from None
    problems = check_prompts(prompts)
    for p in problems:
        print(p)
    print("prompts: ok" if not problems else f"prompts: {len(problems)} problem(s)")
    return EXIT_OK if not problems else EXIT_FAILED


def cmd_synth(args: argparse.Namespace) -> int:
    from logdx.synth.cli import run

    return run(args)
