"""``closedloop model``: local model utilities (``model tiny PATH`` builds the offline test model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from closedloop.models.tiny_presets import DEFAULT_PRESET, TINY_PRESETS


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="local model utilities")
    msub = parser.add_subparsers(dest="model_command", required=True)
    tiny = msub.add_parser("tiny", help="build the tiny offline tool-calling model (CPU, a few minutes; "
                                        "kept or copied from the build cache when built before)",
                           description="Build the tiny tool-calling model (150k parameters, trained here on "
                                       "synthetic tool-use chats). A folder that already holds the same build is "
                                       "kept; a finished build with the same settings is copied from the build cache "
                                       "($CLOSEDLOOP_TINY_CACHE, default ~/.cache/closedloop/tiny; 'off' turns it "
                                       "off); other settings rebuild the folder.")
    tiny.add_argument("path", type=Path, help="directory to write the checkpoint into")
    tiny.add_argument("--preset", choices=list(TINY_PRESETS), default=DEFAULT_PRESET,
                      help="named settings: agent answers the README's arithmetic correctly (the serve script and "
                           "the demo build it); test is the tests' shorter build")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the data, the tokenizer and the weights")
    tiny.add_argument("--steps", type=int, default=None,
                      help="SFT warm-up steps instead of the preset's (0: untrained weights)")
    tiny.add_argument("--quiet", action="store_true", help="no training progress lines")
    tiny.set_defaults(func=_tiny)
    vlm = msub.add_parser("tiny-vlm", help="build a tiny vision-language model (LLaVA architecture) from a tiny "
                                           "text model (seconds)")
    vlm.add_argument("path", type=Path, help="directory to write the checkpoint into")
    vlm.add_argument("--text-model", type=Path, required=True,
                     help="the tiny text checkpoint (`closedloop model tiny`) whose weights become the language half")
    vlm.add_argument("--seed", type=int, default=0, help="seed of the vision tower's weights")
    vlm.set_defaults(func=_tiny_vlm)


def _tiny_vlm(args: argparse.Namespace) -> int:
    from closedloop.terminal import make_console

    from closedloop.models.tiny_vlm import TINY_VLM_FILE, build_tiny_vlm

    console = make_console()
    if not (args.text_model / "config.json").is_file():
        console.print(f"[red]--text-model {args.text_model} is not a checkpoint directory (no config.json)[/red]")
        return 2
    path = build_tiny_vlm(args.path, args.text_model, seed=args.seed)
    record = json.loads((path / TINY_VLM_FILE).read_text())
    console.print(f"tiny VLM saved to {path.resolve()}: {record['n_parameters']:,} parameters, "
                  f"{record['image_tokens']} tokens per image; use it as hf:{path}")
    return 0


def _tiny(args: argparse.Namespace) -> int:
    from closedloop.terminal import make_console
    from rich.table import Table

    from closedloop.models.tiny import TINY_CONFIG_FILE, ensure_tiny_model
    from closedloop.models.tiny_presets import preset_settings
    from closedloop.terminal import JobProgress

    console = make_console()
    settings = preset_settings(args.preset)
    if args.steps is not None:
        if args.steps < 0:
            console.print("[red]--steps must be >= 0[/red]")
            return 2
        settings["train_steps"] = args.steps
    steps = settings["train_steps"]
    if args.quiet:
        path, how = ensure_tiny_model(args.path, seed=args.seed, **settings)
    else:
        with JobProgress(f"tiny model ({args.preset})", steps, unit="steps", every=50) as progress:
            path, how = ensure_tiny_model(args.path, seed=args.seed, log=progress.note,
                                          on_step=lambda step, total, loss: progress.update(step, loss=loss),
                                          **settings)
    record = json.loads((path / TINY_CONFIG_FILE).read_text())
    cfg = record["config"]
    table = Table(title=f"tiny model saved to {path.resolve()}", show_header=False)
    for key, value in [("parameters", f"{record['n_parameters']:,}"), ("vocab", record["vocab_size"]),
                       ("layers x hidden", f"{cfg['num_hidden_layers']} x {cfg['hidden_size']}"),
                       ("seed", cfg["seed"]), ("warm-up steps", cfg["train_steps"]),
                       ("loss first -> last", f"{record['initial_loss']:.3f} -> {record['final_loss']:.3f}"
                        if record["final_loss"] is not None else "untrained"),
                       ("build seconds", record["build_seconds"]),
                       ("this time", {"kept": "kept: the folder already held this build",
                                      "cached": "copied from the build cache", "built": "built"}[how]),
                       ("use it as", f"hf:{path}")]:
        table.add_row(key, str(value))
    console.print(table)
    return 0
