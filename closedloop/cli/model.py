"""``closedloop model``: local model utilities (``model tiny PATH`` builds the offline test model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="local model utilities")
    msub = parser.add_subparsers(dest="model_command", required=True)
    tiny = msub.add_parser("tiny", help="build the tiny offline tool-calling model (CPU, about a minute)")
    tiny.add_argument("path", type=Path, help="directory to write the checkpoint into")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--steps", type=int, default=500, help="SFT warm-up steps (0: untrained weights)")
    tiny.add_argument("--quiet", action="store_true", help="no training progress lines")
    tiny.set_defaults(func=_tiny)
    vlm = msub.add_parser("tiny-vlm", help="build a tiny vision-language model (LLaVA architecture) from a tiny "
                                           "text model (seconds)")
    vlm.add_argument("path", type=Path, help="directory to write the checkpoint into")
    vlm.add_argument("--text-model", type=Path, required=True,
                     help="the tiny text checkpoint (`closedloop model tiny`) whose weights become the language half")
    vlm.add_argument("--seed", type=int, default=0)
    vlm.set_defaults(func=_tiny_vlm)


def _tiny_vlm(args: argparse.Namespace) -> int:
    from rich.console import Console

    from closedloop.models.tiny_vlm import TINY_VLM_FILE, build_tiny_vlm

    console = Console()
    if not (args.text_model / "config.json").is_file():
        console.print(f"[red]--text-model {args.text_model} is not a checkpoint directory (no config.json)[/red]")
        return 2
    path = build_tiny_vlm(args.path, args.text_model, seed=args.seed)
    record = json.loads((path / TINY_VLM_FILE).read_text())
    console.print(f"tiny VLM saved to {path.resolve()}: {record['n_parameters']:,} parameters, "
                  f"{record['image_tokens']} tokens per image; use it as hf:{path}")
    return 0


def _tiny(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from closedloop.models.tiny import TINY_CONFIG_FILE, build_tiny_model

    console = Console()
    if args.steps < 0:
        console.print("[red]--steps must be >= 0[/red]")
        return 2
    log = None if args.quiet else (lambda line: console.print(f"[dim]{line}[/dim]"))
    path = build_tiny_model(args.path, seed=args.seed, train_steps=args.steps, log=log)
    record = json.loads((path / TINY_CONFIG_FILE).read_text())
    cfg = record["config"]
    table = Table(title=f"tiny model saved to {path.resolve()}", show_header=False)
    for key, value in [("parameters", f"{record['n_parameters']:,}"), ("vocab", record["vocab_size"]),
                       ("layers x hidden", f"{cfg['num_hidden_layers']} x {cfg['hidden_size']}"),
                       ("seed", cfg["seed"]), ("warm-up steps", cfg["train_steps"]),
                       ("loss first -> last", f"{record['initial_loss']:.3f} -> {record['final_loss']:.3f}"
                        if record["final_loss"] is not None else "untrained"),
                       ("build seconds", record["build_seconds"]), ("use it as", f"hf:{path}")]:
        table.add_row(key, str(value))
    console.print(table)
    return 0
