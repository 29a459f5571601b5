"""The ``pulsar`` command: a thin layer over :mod:`pulsar.api`.

``build`` flags are generated from the config schema (``--section.field``), so they are parsed here
from the raw words rather than declared one by one.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from pulsar import __version__
from pulsar.errors import PulsarError

_HELP = "pulsar: float ONNX -> quantized, compiled NPU model, driven by one config file."
# add_completion: --install-completion / --show-completion (bash, zsh, fish, powershell) from typer
app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False, help=_HELP)
config_app = typer.Typer(no_args_is_help=True, help="Inspect the config schema, print defaults, validate a file.")
app.add_typer(config_app, name="config")

F = TypeVar("F", bound=Callable[..., Any])
_BUILD_FLAGS = {"--config": "value", "--debug": "bool", "--quiet": "bool", "--help": "bool", "-h": "bool"}


def _fail(message: str, debug: bool = False) -> None:
    """``error: <message>`` on stderr (user text printed literally), exit 2."""
    from rich.text import Text

    from pulsar.ui import console, literal

    if debug:
        console.print_exception()
    for i, line in enumerate(message.split("\n")):
        text = Text("error: " if i == 0 else "  ", style="bold red" if i == 0 else "")
        text.append(literal(line))
        console.print(text, soft_wrap=True, markup=False, highlight=False)
    raise typer.Exit(2)


def guarded(fn: F) -> F:
    """User errors -> one line on stderr, exit 2; a traceback only with --debug."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from pulsar.utils.signals import terminate_as_interrupt

        debug = bool(kwargs.get("debug")) or "--debug" in sys.argv
        try:
            with terminate_as_interrupt():  # SIGTERM unwinds like Ctrl-C: temp files removed, one line
                return fn(*args, **kwargs)
        except PulsarError as e:
            from pulsar.config import ConfigError

            _fail("\n".join(e.problems) if isinstance(e, ConfigError) and len(e.problems) > 1 else str(e), debug)
        except KeyboardInterrupt as e:
            from pulsar.utils.atomic import remove_unfinished
            from pulsar.utils.signals import Terminated

            remove_unfinished()  # a temp file whose own cleanup the interrupt cut short

            how = f"terminated ({e})" if isinstance(e, Terminated) else "interrupted (Ctrl-C)"
            _fail(f"{how}; stopped cleanly, unfinished files removed and earlier results left as they were", debug)
        except MemoryError:
            _fail("out of memory; use smaller input shapes / batch sizes, or a machine with more memory", debug)
        except OSError as e:  # the environment refused something (a safety net: stages name their files)
            where = f"{e.filename}: " if e.filename else ""
            _fail(f"{where}{e.strerror or e}", debug)

    return wrapper  # type: ignore[return-value]


_BUILD_USAGE = "pulsar build --input MODEL.onnx --output_dir DIR [--config CFG] [--section.field VALUE ...]"


def _build_help() -> None:
    """Every flag, on stdout (so ``pulsar build --help | grep calib`` works), tables at full width."""
    from rich.table import Table
    from rich.text import Text

    from pulsar.config.overrides import describe_leaf
    from pulsar.config.schema import default_config, leaves, section_of
    from pulsar.config.support import unavailable_fields
    from pulsar.ui import out_console, print_renderable

    defaults = default_config()
    not_yet = unavailable_fields()

    def default_of(leaf: Any) -> Any:
        node: Any = defaults
        for p in leaf.path:
            node = node.get(p) if isinstance(node, dict) else None
        return node

    out_console.print(f"Usage: {_BUILD_USAGE}\n", markup=False, highlight=False)
    out_console.print("Build a compiled NPU model. Precedence: command line > config file (json/yaml/toml) > "
                      "defaults.", markup=False, highlight=False)
    not_yet_note = (" [not available yet]: the feature is not built in this version; setting the option is an "
                    "error." if not_yet else "")
    out_console.print("Bool flags: bare flag = true, or give true|false|1|0. Lists: several words or a,b,c."
                      f"{not_yet_note}\n", markup=False, highlight=False)

    def new_table(title: str) -> Table:
        t = Table(title=title, title_justify="left")
        for c in ("option", "type", "default", "description"):
            t.add_column(c, overflow="fold")
        return t

    general = new_table("general")
    for row in (("--config", "path", "''", "config file (.json with # comments, .yaml/.yml, .toml)"),
                ("--debug", "bool", "false", "show tracebacks and debug logs"),
                ("--quiet", "bool", "false", "only warnings and errors on the console (build.log has everything)"),
                ("--help, -h", "bool", "", "this help")):
        general.add_row(*row)
    print_renderable(general, target=out_console)
    sections: dict[str, Table] = {}
    for leaf in leaves():
        sec = section_of(leaf)
        if sec not in sections:
            sections[sec] = new_table(sec)
        type_name, default, desc = describe_leaf(leaf, default_of)
        dotted = ".".join(leaf.path)
        text = Text(desc)
        if dotted in not_yet:
            text = Text("[not available yet] ", style="yellow") + text
        sections[sec].add_row(Text(leaf.flag), Text(type_name), Text(default), text)
    for t in sections.values():
        print_renderable(t, target=out_console)


def _build_usage_error() -> None:
    from pulsar.ui import console

    console.print(f"Usage: {_BUILD_USAGE}", markup=False, highlight=False, soft_wrap=True)
    console.print("Try 'pulsar build --help' for every option.", markup=False, highlight=False)
    _fail("pulsar build needs --input and --output_dir (or a --config that sets them)")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False, help="Build: optimize, calibrate, quantize and compile a model (see --help).")
def build(ctx: typer.Context) -> None:
    _build(list(ctx.args))


@guarded
def _build(words: list[str]) -> None:
    from pulsar.config.overrides import parse_overrides

    if "--help" in words or "-h" in words:
        _build_help()
        return
    if not words:
        _build_usage_error()
    overrides, others = parse_overrides(words, extra_flags=_BUILD_FLAGS)
    from pulsar.frontend.loader import check_model_path, is_quant_output

    # a recompile's input is a build dir (model_type may be in the config file): checked by the build
    recompile = overrides.get("model_type") in ("QuantModel", "QuantAxModel")
    if isinstance(overrides.get("input"), str) and not re.search(r"[\x00-\x1f\x7f]", overrides["input"]) \
            and not recompile and not is_quant_output(overrides["input"]):
        check_model_path(overrides["input"], "--input")  # the config's errors name its `input` field
    from pulsar.api import build as api_build

    api_build(config=others.get("--config"), overrides=overrides, quiet=bool(others.get("--quiet")),
              debug=bool(others.get("--debug")))


@app.command(help="Run a compiled model: read inputs per tensor, write one .npy per output.")
@guarded
def run(
    model: Annotated[Path, typer.Option("--model", help="compiled model file")],
    output_dir: Annotated[Path, typer.Option("--output_dir", help="where the .npy outputs go")],
    input_dir: Annotated[Path | None, typer.Option("--input_dir", help="files <tensor>.npy / .bin")] = None,
    list_file: Annotated[Path | None, typer.Option("--list", help="text file: one sample dir per line")] = None,
    random_input: Annotated[bool, typer.Option("--random_input", help="feed seeded random inputs")] = False,
    mode: Annotated[str, typer.Option("--mode", help="NPUBackend (bit-exact integer simulation) or Reference "
                                                     "(float QDQ in onnxruntime)")] = "NPUBackend",
    batch_size: Annotated[int, typer.Option("--batch_size", help="samples stacked on axis 0 of each input "
                                                                 "file; a multi-batch model runs them as its "
                                                                 "compiled batches, largest first")] = 1,
    group_index: Annotated[int, typer.Option("--group_index", help="shape group to run: 0 is the model's own "
                                                                   "input shape, i the i-th src_extra_shapes "
                                                                   "entry (pulsar info lists them)")] = 0,
    perlayer: Annotated[bool, typer.Option("--enable_perlayer_output", help="also write every tensor to "
                                                                            "<output_dir>/perlayer/")] = False,
    workers: Annotated[int | None, typer.Option("--workers", help="independent samples run in parallel, one "
                                                                  "core each (default: one per core)")] = None,
    op_plugin: Annotated[list[Path] | None, typer.Option("--op_plugin", help="operator plugin file (.py) for the "
                                                                        "model's custom ops, repeatable (default: the "
                                                                        "files the build recorded)")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    from pulsar.core.custom_ops import load_plugins
    from pulsar.runtime.runner import run_model

    load_plugins(op_plugin or [], "--op_plugin")
    from pulsar.ui import out_console, plural, print_literal, print_renderable, table

    result = run_model(model=model, output_dir=output_dir, input_dir=input_dir, list_file=list_file,
                       random_input=random_input, mode=mode, batch_size=batch_size, perlayer=perlayer,
                       workers=workers, group=group_index)
    rows = [(name, "x".join(map(str, shape)) or "scalar", str(dtype)) for name, shape, dtype in result.outputs]
    print_renderable(table("Outputs (per sample)", ["output", "shape", "dtype"], rows), target=out_console)
    where = f"{result.output_dir}/<sample>/ ({len(result.sample_dirs)} directories)" if result.sample_dirs \
        else str(result.output_dir)
    print_literal(f"{plural(result.samples, 'sample')} in {result.seconds:.3f} s: {result.ms_per_sample:.1f} ms per "
                  f"sample ({mode}), after a {1000 * (result.warmup_seconds or 0):.1f} ms warm-up run (not counted); "
                  f"outputs in {where}", target=out_console)


@app.command(help="Build over a search space and report the Pareto front of a metric against estimated latency.")
@guarded
def sweep(
    input: Annotated[Path, typer.Option("--input", help="float ONNX model")],
    space: Annotated[Path, typer.Option("--space", help="search space (.yaml / .json / .toml): dotted config "
                                                        "field -> list of values")],
    output_dir: Annotated[Path, typer.Option("--output_dir", help="sweep.json / .png / .html and trials/<k>/")],
    config: Annotated[Path | None, typer.Option("--config", help="base build config")] = None,
    metric: Annotated[str | None, typer.Option("--metric", help="built-in metric or MODULE:FUNCTION / "
                                                                "FILE.py:FUNCTION (default: evaluation.metric "
                                                                "of the base config)")] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="trials built at once (default: cores, "
                                                                  "bounded by memory)")] = None,
    ray: Annotated[str | None, typer.Option("--ray", help="run the trials as tasks on a Ray cluster at ADDRESS "
                                                          "(bare --ray: a local Ray instance); needs the "
                                                          "[ray] extra")] = None,
    target_metric: Annotated[float | None, typer.Option("--target_metric", help="stop launching trials once "
                                                                                "one reaches this metric; the "
                                                                                "report names the fastest that "
                                                                                "does")] = None,
    old_target_metric: Annotated[float | None, typer.Option("--target-metric", hidden=True)] = None,  # old scripts
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    from pulsar.search import sweep as run_sweep
    from pulsar.ui import out_console, print_renderable, table

    if old_target_metric is not None:
        if target_metric is not None:
            raise PulsarError("--target-metric is the old spelling of --target_metric; give one of them")
        target_metric = old_target_metric
    rows = run_sweep(input, config, space, output_dir, metric=metric, workers=workers, ray=ray,
                     target_metric=target_metric)
    fields = sorted({f for r in rows for f in r["settings"]})
    body = [(str(r["trial"]), *(str(r["settings"].get(f)) for f in fields), r["status"],
             "" if r.get("metric") is None else f"{r['metric']:.6g}",
             "" if r.get("latency_ms") is None else f"{r['latency_ms']:.4g}", "yes" if r.get("pareto") else "")
            for r in rows]
    print_renderable(table(f"Sweep ({output_dir}/sweep.json)", ["trial", *fields, "status", "metric", "latency ms",
                                                               "pareto"], body), target=out_console)
    if rows and not any(r["status"] == "ok" for r in rows):
        raise PulsarError(f"every trial failed (trial {rows[0]['trial']}: {rows[0].get('error')}); each trial's "
                          f"error is in {output_dir}/sweep.json")


@app.command(help="Show a compiled model: inputs / outputs, subgraphs, target, estimate, versions.")
@guarded
def info(
    model: Annotated[Path, typer.Argument(help="compiled model file")],
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    from pulsar.runtime.info import model_summary
    from pulsar.ui import out_console, print_renderable

    for t in model_summary(model):
        print_renderable(t, target=out_console)


@config_app.command("schema", help="Print the JSON Schema of the build config.")
def config_schema() -> None:
    from pulsar.config import load_schema

    typer.echo(json.dumps(load_schema(), indent=2))


@config_app.command("defaults", help="Print a complete config with every default (json, yaml or toml).")
@guarded
def config_defaults(
    fmt: Annotated[str, typer.Option("--format", help="json | yaml | toml")] = "json",
) -> None:
    from pulsar.config.dump import dump_config
    from pulsar.config.schema import default_config

    typer.echo(dump_config(default_config(), fmt), nl=False)


@config_app.command("validate", help="Validate a config file (optionally against a model: tensor / layer names).")
@guarded
def config_validate(
    path: Annotated[Path, typer.Argument(help="config file")],
    model: Annotated[Path | None, typer.Option("--input", help="also check names against this ONNX model")] = None,
    debug: Annotated[bool, typer.Option("--debug")] = False,
) -> None:
    from pulsar.config import load_build_config
    from pulsar.ui import out_console, setup_logging

    setup_logging()  # a switched-off field's warning reads as in a build
    eff = load_build_config(path, require_io=False)
    if model is not None:
        from pulsar.config.semantic import check_against_model
        from pulsar.frontend.loader import load_model

        check_against_model(eff.cfg, load_model(model, source="--input"), source=str(path))
    from rich.text import Text

    from pulsar.ui import literal

    out_console.print(Text("ok", style="green") + Text(f": {literal(path)} is a valid pulsar build config"),
                      soft_wrap=True)


@app.command(help="Print the pulsar version.")
def version() -> None:
    typer.echo(f"pulsar {__version__}")


def _print_version(value: bool) -> None:
    """``pulsar --version``: what ``pulsar version`` prints (stdout, exit 0), before any command runs."""
    if value:
        version()
        raise typer.Exit(0)


@app.callback(help=_HELP)
def _root(
    show_version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                               help="print the pulsar version and exit")] = False,
) -> None:
    pass


def _escape_markup(command: Any) -> None:
    """Every help text shown as written: typer reads help as rich markup, where ``[ray]`` vanishes."""
    from rich.markup import escape

    for obj in (command, *getattr(command, "params", ())):
        for attr in ("help", "short_help"):
            if isinstance(getattr(obj, attr, None), str):
                setattr(obj, attr, escape(getattr(obj, attr)))
    for sub in getattr(command, "commands", {}).values():
        _escape_markup(sub)


_NOT_A = {"int_parsing": "an integer", "int_from_float": "an integer", "float_parsing": "a number",
          "bool_parsing": "a boolean", "integer": "an integer", "float": "a number"}


def _bad_value(e: Any) -> str | None:
    """``--batch_size: 'ten' is not an integer``: a value of the wrong type, worded as ``pulsar build``
    words it (typer's own message comes from pydantic or click)."""
    param = getattr(e, "param", None)
    if param is None:
        return None
    flags = [o for o in param.opts if o.startswith("-")]
    flag = max(flags, key=len) if flags else str(param.name or "value").upper()
    errors = e.__cause__.errors() if hasattr(e.__cause__, "errors") else []  # typer >= 0.22: pydantic
    if errors and errors[0].get("type") in _NOT_A:
        return f"{flag}: '{errors[0].get('input')}' is not {_NOT_A[errors[0]['type']]}"
    old = re.match(r"'(.*)' is not a valid (integer|float)", str(e.message))  # click's own wording
    if old:
        return f"{flag}: '{old.group(1)}' is not {_NOT_A[old.group(2)]}"
    return f"{flag}: {e.message}"


_SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")  # what typer's completion scripts cover


def _shell(named: str | None) -> str:
    """The shell to complete: the one named after the flag, else the one this runs in (as typer
    detects it), else ``$SHELL``."""
    if named:
        return named
    try:
        import shellingham  # typer's dependency, how typer itself detects the shell

        return str(shellingham.detect_shell()[0]).lower()
    except Exception:  # noqa: BLE001 (not installed, ShellDetectionFailure, an unreadable process table)
        return Path(os.environ.get("SHELL", "")).name.lower()


@guarded
def _completion(argv: list[str]) -> bool:
    """``pulsar --show-completion [SHELL]`` / ``--install-completion [SHELL]``: typer's scripts, for a
    shell that can be named (typer's own flags only detect it, and answer an unknown one with exit 1);
    True when it was one of them."""
    if len(argv) < 2 or argv[1] not in ("--show-completion", "--install-completion"):
        return False
    from typer.completion import get_completion_script, install  # type: ignore[attr-defined]

    shell = _shell(argv[2] if len(argv) > 2 and not argv[2].startswith("-") else None)
    if shell not in _SHELLS:
        raise PulsarError(f"{argv[1]}: cannot complete for {repr(shell) if shell else 'an unknown shell'}; name "
                          f"one of {', '.join(_SHELLS)} (e.g. pulsar {argv[1]} bash)")
    names = {"prog_name": "pulsar", "complete_var": "_PULSAR_COMPLETE"}
    if argv[1] == "--show-completion":
        typer.echo(get_completion_script(shell=shell, **names))
    else:
        shell, path = install(shell=shell, **names)
        typer.echo(f"{shell} completion installed in {path}; it takes effect in a new shell")
    return True


def _bare_ray(argv: list[str]) -> None:
    """``pulsar sweep --ray`` with no address means a local Ray instance: give the option its value."""
    if len(argv) > 1 and argv[1] == "sweep":
        for i, arg in enumerate(argv):
            if arg == "--ray" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                argv.insert(i + 1, "local")
                break


def main() -> None:
    """Run the CLI; a usage error (unknown option, missing value) is one ``error:`` line, exit 2."""
    try:  # typer >= 0.22 vendors click
        from typer._click import exceptions as click
    except ImportError:  # pragma: no cover (older typer: the click package)
        import click.exceptions as click  # type: ignore[no-redef]

    _bare_ray(sys.argv)
    try:
        if _completion(sys.argv):
            sys.exit(0)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    command = typer.main.get_command(app)
    _escape_markup(command)
    try:
        code = command(standalone_mode=False, prog_name="pulsar")
    except click.UsageError as e:
        from pulsar.ui import console

        bad = _bad_value(e) if isinstance(e, click.BadParameter) and not isinstance(e, click.MissingParameter) \
            else None
        message = bad or e.format_message() or "give a command: build, run, info, config or version (see --help)"
        if e.ctx is not None and e.format_message() and bad is None:
            console.print(e.ctx.get_usage(), markup=False, highlight=False, soft_wrap=True)
        try:
            _fail(message)
        except typer.Exit:
            sys.exit(2)
    except typer.Abort:
        try:
            _fail("interrupted (Ctrl-C)")
        except typer.Exit:
            sys.exit(2)
    except typer.Exit as e:  # typer.Exit from commands (a usage error's exit 2 included)
        sys.exit(getattr(e, "exit_code", 0))
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
