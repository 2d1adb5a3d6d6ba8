"""timm-flashwin: verify, list, bench and run from the command line (also python -m timm_flashwin).

The logic lives in the library (verify.py, discovery.py, bench.py, runner.py); this file parses
arguments and prints. Exit codes: 0 success, 1 a mismatch (verify) or nothing matched (list),
2 a usage problem; run exits as the script does. Only the standard library (and the rule's
plain values, tolerances.py) is imported at the top: torch and timm take seconds to import,
and ``--help``, ``--version`` or a usage error needs neither.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
from typing import List, Optional

from .tolerances import defaults, possessive, rule, rule_lines

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2


def error_columns(library: str = "timm") -> str:
    """Under verify's tables: why "timm err" and "patched err" can differ beside a 0 difference."""
    return (f"err: vs float64; {library} err is the larger of two {library} runs (the second on images moved by one "
            f"ulp), so it can differ from patched err where patched vs {library} is 0")


ERROR_COLUMNS = error_columns()


# Argument types: a bad value is a usage problem (exit 2, argparse's one line naming the
# option), not a traceback from deep inside the model.
def _img_size(text: str):
    try:
        parts = [int(p) for p in text.lower().replace("x", ",").split(",") if p]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected N or H,W of positive integers, got {text!r}")
    return parts[0] if len(parts) == 1 else tuple(parts)


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _integer(text, 1)


def _count(text: str) -> int:
    return _integer(text, 0)


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0.0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _device(text: str) -> str:
    """cpu, cuda or cuda:N: what verify runs on (torch.device takes more, such as meta or
    mps, where verify cannot run)."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


#: --hf: a transformers model instead of a timm one (timm_flashwin/hf_models.py)
HF_HELP = ("a transformers model: a model type (swin, swinv2, donut-swin, maskformer-swin, swin2sr, beit, "
           "data2vec-vision, sam, sam_hq, vitdet), a config class (SwinConfig, SamVisionConfig), or a config.json / "
           "saved model directory; ':ModelClass' picks the head; random "
           "weights unless --pretrained (verify) reads them from that directory")


#: --tv: a torchvision model instead of a timm one (timm_flashwin/tools/tv_models.py)
TV_HELP = ("a torchvision model (swin_t, swin_v2_t, swin3d_t, ...: `list --tv` shows them), random weights unless "
           "--pretrained; video models take clips of 16 frames")


def _model_name(args) -> str:
    """The timm model name, or --hf's CONFIG or --tv's NAME as verify_model and benchmark_model take it."""
    from .hf_models import HF_PREFIX
    from .tv_models import TV_PREFIX
    from .usage import UsageError
    given = [value for value in (args.name, args.hf, args.tv) if value is not None]
    if len(given) != 1:
        raise UsageError("give a timm model name, --hf CONFIG or --tv NAME, one of them")
    return HF_PREFIX + args.hf if args.hf is not None else TV_PREFIX + args.tv if args.tv is not None else args.name


class _Versions(argparse.Action):
    """--version: this package's and the libraries' versions it runs with (read from their
    installed metadata, nothing imported)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="show the versions of timm-flashwin, torch, triton, "
                                                               "timm and transformers, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib import metadata

        from .. import __version__
        found = []
        for name in ("torch", "triton", "timm", "transformers"):
            try:
                found.append(f"{name} {metadata.version(name)}")
            except metadata.PackageNotFoundError:
                found.append(f"{name} not installed")
        print(f"timm-flashwin {__version__} ({', '.join(found)})")  # stdout, as argparse's version action
        parser.exit()


VERIFY_DESCRIPTION = (
    "Compare a patched model with the unpatched one, each against a float64 copy of the unpatched model: every "
    "window-attention layer's output, the model's output and, with --train, every parameter's gradient. "
    f"The rule: {rule()}; the unpatched model runs twice (the second time on images moved by one ulp) and its "
    f"larger error counts. Default rtol / atol by --dtype: {defaults()}. Exit code 0 when every tensor passes, 1 "
    "when one does not, 2 for a usage problem. Random weights are perturbed so that attention matters "
    "(--pretrained or --checkpoint for real ones).")
BENCH_DESCRIPTION = (
    "Time the unpatched model and the patched one, one after the other: inference, or AMP training steps with "
    "--train; eager, or torch.compile with --compile / --compile-mode. Prints images/s, the median step, the peak "
    "memory and the first iteration's time. Needs a CUDA GPU (on a CPU it exits 2). Several rounds, host and GPU "
    "time side by side: benchmarks/bench_train.py in the repository.")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="timm-flashwin", description="Fused Triton window attention for timm's "
                                     "window-attention models (Swin, SwinV2, MaxViT, CoAtNet, ...; `list` shows them). "
                                     "On a CPU, patched models compute in PyTorch (TRITON_INTERPRET=1: the kernels, "
                                     "slowly).")
    parser.add_argument("--version", action=_Versions)
    sub = parser.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="compare a patched model with the unpatched one, layer by layer",
                       description=VERIFY_DESCRIPTION)
    v.add_argument("name", nargs="?", help="timm model name (or --hf)")
    v.add_argument("--hf", metavar="CONFIG", help=HF_HELP)
    v.add_argument("--tv", metavar="NAME", help=TV_HELP)
    v.add_argument("--img-size", type=_img_size, default=None, help="N or H,W (default: the model's)")
    v.add_argument("--batch", type=_positive_int, default=2, help="images per forward (default: 2)")
    v.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="float16/bfloat16 run under autocast with float32 weights")
    v.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda when available, "
                                                                 "else cpu)")
    v.add_argument("--train", action="store_true", help="also compare every parameter's gradient")
    v.add_argument("--checkpoint", default=None, help="local .pth / .safetensors weights")
    v.add_argument("--pretrained", action="store_true", help="timm's hub weights")
    v.add_argument("--seed", type=_count, default=0,
                   help="random init, perturbation, images and dropout: the same seed, the same run")
    v.add_argument("--rtol", type=_tolerance, default=None, help=f"relative tolerance (default by dtype: {defaults()}, "
                                                                   "rtol / atol)")
    v.add_argument("--atol", type=_tolerance, default=None, help="absolute floor, relative to the float64 tensor's "
                                                                   "rms (default by dtype, as --rtol says)")
    v.add_argument("--json", action="store_true", help="print one JSON object")

    ls = sub.add_parser("list", help="timm models whose window attention is patched",
                        description="The timm models (matching PATTERN) whose window-attention modules patch_model "
                                    "serves: family, windows per stage, module count. Exit code 1 when none matches.")
    ls.add_argument("pattern", nargs="?", default="*", help="as timm.list_models, e.g. 'swinv2*'")
    ls.add_argument("--tv", action="store_true", help="torchvision's models instead of timm's")
    ls.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="images/s and peak memory, unpatched against patched (needs a CUDA GPU)",
                       description=BENCH_DESCRIPTION)
    b.add_argument("name", nargs="?", help="timm model name (or --hf)")
    b.add_argument("--hf", metavar="CONFIG", help=HF_HELP)
    b.add_argument("--tv", metavar="NAME", help=TV_HELP)
    b.add_argument("--batch", type=_positive_int, default=64, help="images per step (default: 64)")
    b.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16",
                   help="weights (inference) or autocast (training) dtype (default: bfloat16)")
    b.add_argument("--img-size", type=_img_size, default=None, help="N or H,W (default: the model's)")
    b.add_argument("--train", action="store_true", help="AMP training steps instead of inference")
    b.add_argument("--compile", action="store_true", help="torch.compile both sides")
    b.add_argument("--compile-mode", choices=["default", "reduce-overhead", "max-autotune"], default=None,
                   help="torch.compile both sides with this mode (implies --compile); reduce-overhead uses "
                        "CUDA graphs, for training steps bound by kernel launches")
    b.add_argument("--recompute-qkv", nargs="*", default=None, metavar="NAME_PREFIX",
                   help="also the model patched with recompute_qkv=True (less training memory, a third row); "
                        "with names, only for the attention modules whose qualified names start with one "
                        "(e.g. layers.1.; give the model's name before this option)")
    b.add_argument("--warmup", type=_count, default=10, help="steps before timing (default: 10)")
    b.add_argument("--repeats", type=_positive_int, default=30, help="timed steps (default: 30)")
    b.add_argument("--json", action="store_true")

    r = sub.add_parser("run", help="run a Python script or module (-m) as python would, every model timm's "
                                   "factory returns patched",
                       usage="timm-flashwin run [options] (SCRIPT | -m MODULE) [ARGS ...]")
    r.add_argument("--report", action="store_true", help="print each created model's patch report at exit (stderr)")
    r.add_argument("--no-feature-map", action="store_true", help="patch_model(feature_map=False)")
    r.add_argument("--recompute-qkv", action="store_true", help="patch_model(recompute_qkv=True)")
    r.add_argument("--strict", action="store_true", help="patch_model(strict=True): a model with a window-attention "
                                                         "module the op cannot serve raises PatchError in the script")
    r.add_argument("target", nargs=argparse.REMAINDER, help="SCRIPT or -m MODULE, then its arguments "
                                                            "(options of run go before it)")
    parser.commands = dict(verify=v, list=ls, bench=b, run=r)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: List[str]) -> argparse.Namespace:
    """``parser.parse_args``, with an unknown option of a subcommand reported by that
    subcommand (its usage, not the top level's) with the nearest option it has."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = parser.commands[args.command]
        options = [o for action in command._actions for o in action.option_strings]
        hints = [f"{word}: did you mean {close[0]}?" for word in unknown if word.startswith("-")
                 for close in [difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.6)] if close]
        command.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else ""))
    return args


def _console():
    """rich console; wide when not a terminal, so that piped output keeps whole names."""
    from rich.console import Console
    return Console() if sys.stdout.isatty() else Console(width=160)


def _ok(c) -> str:
    if c.ill_conditioned:
        return "[yellow]ill-cond.[/yellow]"
    return "[green]yes[/green]" if c.passed else "[red]NO[/red]"


def _fmt(x: float) -> str:
    return "nan" if isinstance(x, float) and math.isnan(x) else f"{x:.2e}"


def _verify(args) -> int:
    from rich.table import Table

    from .verify import verify_model
    result = verify_model(_model_name(args), img_size=args.img_size, batch=args.batch, dtype=args.dtype,
                          device=args.device, train=args.train, checkpoint=args.checkpoint, pretrained=args.pretrained, seed=args.seed,
                          rtol=args.rtol, atol=args.atol)
    if args.json:
        print(json.dumps(result.to_dict()))
        return EXIT_OK if result.passed else EXIT_MISMATCH
    console = _console()
    s = result.settings
    library = s.get("library", "timm")  # what the unpatched model is: timm's, torchvision's or transformers'
    console.print(f"[bold]{result.model}[/bold]  img {'x'.join(map(str, s['img_size']))}  batch {s['batch']}  "
                  f"{s['dtype']}  {s['device']}  {'train' if s['train'] else 'eval'}  attention: {result.backend}")
    for line in rule_lines(f"{s['rtol']:.0e}", f"{s['atol']:.0e}", library):
        console.print(line, markup=False)
    if result.perturbed:
        console.print("weights: random init, perturbed so that attention matters (LayerNorm weights, logit scales "
                      "across the clamp, bias tables); pass --pretrained or --checkpoint for real weights")
    table = Table(title="window-attention layers (error vs a float64 copy of the unpatched model)")
    for col in ("layer", f"{library} err", "patched err", f"patched vs {library}", "max |diff|", "ok"):
        table.add_column(col, justify="left" if col == "layer" else "right", overflow="fold")
    rows = result.layers + [result.output]
    for c in rows:
        table.add_row(c.name, _fmt(c.err_timm), _fmt(c.err_ours), _fmt(c.diff), _fmt(c.max_abs), _ok(c))
    console.print(table)
    console.print(error_columns(library))
    console.print(f"top-1 agreement: patched vs {library} {result.top1_agreement:.1%}, {library} vs float64 "
                  f"{result.top1_timm_vs_float64:.1%}, patched vs float64 {result.top1_ours_vs_float64:.1%}"
                  + (f"   (float16 loss scale {result.loss_scale:g})" if result.loss_scale != 1.0 else ""))
    if result.grads:
        worst = sorted(result.grads, key=lambda c: (c.passed, c.ill_conditioned,
                                                    -(c.err_ours if not math.isnan(c.err_ours) else 1e9)))
        gt = Table(title=f"gradients: {sum(c.passed for c in result.grads)}/{len(result.grads)} within tolerance "
                         f"(10 largest errors; {possessive(library)} error over all gradients "
                         f"{_fmt(result.gradient_floor)})")
        for col in ("parameter", f"{library} err", "patched err", f"patched vs {library}", "ok"):
            gt.add_column(col, justify="left" if col == "parameter" else "right", overflow="fold")
        for c in worst[:10]:
            gt.add_row(c.name, _fmt(c.err_timm), _fmt(c.err_ours), _fmt(c.diff), _ok(c))
        console.print(gt)
        ill = sum(c.ill_conditioned for c in result.grads)
        if ill:
            console.print(f"{ill} gradient(s) ill-conditioned at this precision ({possessive(library)} own error "
                          ">= 100 %): "
                          "reported, not judged")
    console.print(("[green]" if result.passed else "[red]") + result.verdict())
    return EXIT_OK if result.passed else EXIT_MISMATCH


def _list(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from .discovery import supported_models, supported_tv_models
    library = "torchvision" if args.tv else "timm"
    # building every candidate takes a while: a bar on a terminal's stderr (transient), else nothing
    with Progress(console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task(f"building {library}'s candidate models on the meta device", total=None)
        infos = (supported_tv_models if args.tv else supported_models)(
            args.pattern, progress=lambda done, total: bar.update(task, completed=done, total=total))
    if not infos:
        if args.json:
            print("[]")
        print(f"timm-flashwin list: no {library} model matching {args.pattern!r} has window attention that "
              "timm_flashwin patches (timm-flashwin list shows them all)", file=sys.stderr)
        return EXIT_MISMATCH
    if args.json:
        print(json.dumps([dict(name=i.name, families=i.families, stage_windows=[list(w) if w else None for w in i.stage_windows],
                               modules=i.modules) for i in infos]))
        return EXIT_OK
    table = Table(title=f"{len(infos)} {library} models with patched window attention ({args.pattern})")
    for col in ("model", "family", "windows per stage", "modules"):
        table.add_column(col)
    for i in infos:
        windows = " ".join("x".join(map(str, w)) if w else "any" for w in i.stage_windows)
        table.add_row(i.name, ",".join(i.families), windows, str(i.modules))
    _console().print(table)
    return EXIT_OK


def _bench(args) -> int:
    from rich.progress import Progress
    from rich.table import Table

    from .bench import benchmark_model, recompute_qkv_option
    with Progress(transient=True, disable=args.json) as progress:
        tasks = {}

        def report(variant: str, done: int, total: int) -> None:
            if variant not in tasks:
                tasks[variant] = progress.add_task(variant, total=total)
            progress.update(tasks[variant], completed=done)

        result = benchmark_model(_model_name(args), batch=args.batch, dtype=args.dtype, train=args.train,
                                 compile=args.compile or args.compile_mode is not None,
                                 compile_mode=args.compile_mode, img_size=args.img_size, warmup=args.warmup,
                                 repeats=args.repeats, progress=report,
                                 recompute_qkv=recompute_qkv_option(args.recompute_qkv))
    if args.json:
        print(json.dumps(result.to_dict()))
        return EXIT_OK
    s = result.settings
    table = Table(title=f"{result.model}  batch {s['batch']}  {s['dtype']}  {'train (AMP)' if s['train'] else 'inference'}"
                        f"  {s['device']}")
    for col in ("variant", "images/s", "median ms", "peak MiB", "first iter s"):
        table.add_column(col, justify="right")
    for r in result.runs:
        table.add_row(r.variant, f"{r.images_per_s:.1f}", f"{r.median_ms:.2f}", f"{r.peak_mib:.0f}",
                      f"{r.first_iter_s:.1f}")
    console = _console()
    console.print(table)
    console.print(f"speedup {result.speedup():.2f}x ({result.patched_modules} attention modules patched)")
    return EXIT_OK


def _run(parser: argparse.ArgumentParser, argv: List[str]) -> int:
    from .runner import run, split_argv
    own, target = split_argv(argv)
    args = _parse(parser, ["run", *own])  # --help and unknown options exit here
    if target is None:
        parser.error("run: a script or -m MODULE is required")
    return run(target, report=args.report, strict=args.strict, recompute_qkv=args.recompute_qkv,
               feature_map=not args.no_feature_map)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if argv[:1] == ["run"]:  # the script's arguments are not ours to parse
        return _run(parser, argv[1:])
    args = _parse(parser, argv)
    from .usage import UsageError
    try:
        return {"verify": _verify, "list": _list, "bench": _bench}[args.command](args)
    except UsageError as exc:
        print(f"timm-flashwin {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def console_main() -> None:
    """Entry point of the ``timm-flashwin`` console script."""
    sys.exit(main())
