"""``closedloop serve``: serve a model spec over OpenAI's chat completions API."""

from __future__ import annotations

import argparse
import sys

from closedloop.models.prompt_cache import SERVE_PROMPT_CACHE_TOKENS

# Defaults of closedloop.server.connections.ConnectionLimits, repeated so --help needs no server import.
_LIMITS = {"header_timeout_s": 20.0, "body_timeout_s": 60.0, "idle_timeout_s": 5.0, "max_connections": 1000}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", required=True, help="model spec, e.g. hf:/path/to/checkpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--served-name", default=None,
                   help="the model name clients must send (default: the spec's model part)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="hf: most requests decoded together (the backend's default when unset)")
    p.add_argument("--batch-wait-ms", type=float, default=0.0,
                   help="hf: how long an idle decoder waits for more requests before it starts (default 0: a "
                        "server's requests arrive independently, and any that arrive later join the running "
                        "batch at its next token)")
    p.add_argument("--prompt-cache-tokens", type=int, default=SERVE_PROMPT_CACHE_TOKENS,
                   help="hf: prompt tokens whose prefill state (KV cache, next-token logits) is kept, so a repeated "
                        "prompt joins the batch without a prefill pass (as vLLM's prefix caching, for whole "
                        "prompts; emptied whenever the weights change); 0 turns it off")
    p.add_argument("--device", default=None, help="hf: torch device, e.g. cuda or cpu (default: cpu)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="hf: torch intra-op threads; 1 avoids OpenMP oversubscription on a shared CPU")
    p.add_argument("--engine", choices=["process", "thread"], default="process",
                   help="hf: where the model decodes: in a child process (default: the HTTP event loop and the "
                        "decoder do not share one GIL, as vLLM splits its API server from its engine) or on a "
                        "thread of the server process")
    p.add_argument("--engine-cpus", choices=["auto", "none"], default="auto",
                   help="hf: on CPU with --engine process, 'auto' binds the engine to the last --torch-threads "
                        "CPUs (default: all but one) and the server to the others, so the scheduler does not move "
                        "the decode thread between cores (as vLLM's CPU backend binds its threads); 'none' leaves "
                        "placement to the OS")
    p.add_argument("--allow-weight-updates", action="store_true",
                   help="enable the admin endpoint POST /closedloop/v1/load_weights, which reloads the served "
                        "hf:/vllm: model's weights from a directory on this machine (for a trainer pushing its "
                        "weights; off by default: keep such a server on a loopback address)")
    p.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest request body accepted (413 above it; default 8 MiB)")
    p.add_argument("--max-tokens-cap", type=int, default=32768,
                   help="largest max_tokens a request may ask for (400 above it, as OpenAI)")
    p.add_argument("--header-timeout", type=float, default=_LIMITS["header_timeout_s"], metavar="S",
                   help="seconds a client has to send a request's line and headers, from opening the connection "
                        "(or the request's first byte on a kept-alive one); then it is closed (default %(default)s)")
    p.add_argument("--body-timeout", type=float, default=_LIMITS["body_timeout_s"], metavar="S",
                   help="seconds a client has to send a request's body after its headers (default %(default)s)")
    p.add_argument("--idle-timeout", type=float, default=_LIMITS["idle_timeout_s"], metavar="S",
                   help="seconds a kept-alive connection may wait for its next request (uvicorn's keep-alive "
                        "timeout; default %(default)s)")
    p.add_argument("--max-connections", type=int, default=_LIMITS["max_connections"], metavar="N",
                   help="connections open at once; one more is answered 503 and closed (default %(default)s)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info: one line per request)")
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from closedloop.models import ModelClient, make_client, parse_spec
    from closedloop.server import create_app
    from closedloop.server.connections import ConnectionLimits, uvicorn_config

    from closedloop.models.locate import locate_checkpoint

    try:
        spec = parse_spec(args.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"error: port {args.port} is out of range", file=sys.stderr)
        return 2
    if args.max_request_bytes < 1 or not 1 <= args.max_tokens <= args.max_tokens_cap:
        print("error: --max-request-bytes must be >= 1 and --max-tokens between 1 and --max-tokens-cap",
              file=sys.stderr)
        return 2
    try:
        limits = ConnectionLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                                  idle_timeout_s=args.idle_timeout, max_connections=args.max_connections)
    except ValidationError as e:
        flags = {"header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout",
                 "idle_timeout_s": "--idle-timeout", "max_connections": "--max-connections"}
        err = e.errors()[0]
        print(f"error: {flags.get(str(err['loc'][0]), err['loc'][0])} {err['msg'].lower()}", file=sys.stderr)
        return 2
    if spec.backend in ("hf", "vllm"):  # after the flags (cheap), before an engine process starts loading it
        try:
            locate_checkpoint(spec.model)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    kwargs = {}
    if spec.backend == "hf":
        if args.max_batch_size is not None:
            if args.max_batch_size < 1:
                print("error: --max-batch-size must be >= 1", file=sys.stderr)
                return 2
            kwargs["max_batch_size"] = args.max_batch_size
        if args.batch_wait_ms < 0:
            print("error: --batch-wait-ms must be >= 0", file=sys.stderr)
            return 2
        kwargs["batch_wait_ms"] = args.batch_wait_ms
        if args.prompt_cache_tokens < 0:
            print("error: --prompt-cache-tokens must be >= 0", file=sys.stderr)
            return 2
        kwargs["prompt_cache_tokens"] = args.prompt_cache_tokens
        if args.device:
            kwargs["device"] = args.device
        if args.torch_threads is not None:
            if args.torch_threads < 1:
                print("error: --torch-threads must be >= 1", file=sys.stderr)
                return 2
            import torch

            torch.set_num_threads(args.torch_threads)
    elif args.max_batch_size is not None or args.device or args.torch_threads is not None:
        print(f"error: --max-batch-size, --device and --torch-threads apply to hf: models, not {spec.backend}:",
              file=sys.stderr)
        return 2
    if args.allow_weight_updates:
        if spec.backend == "openai":
            print("error: --allow-weight-updates needs a local model (hf: or vllm:), not openai:", file=sys.stderr)
            return 2
        if spec.backend == "vllm":
            kwargs["weight_updates"] = True  # the engine core in this process, where the weights can be loaded
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: --allow-weight-updates on {args.host}: anyone who can reach this address can replace "
                  "the model's weights and make the server read local directories", file=sys.stderr)
    if spec.backend == "hf" and args.engine == "process":
        from closedloop.models.engine_process import EngineProcessClient

        from closedloop.models.cpu_binding import bind_this_process, split_cpus

        split = split_cpus(args.torch_threads) \
            if args.engine_cpus == "auto" and args.device in (None, "cpu") else None
        engine_cpus, server_cpus = split if split is not None else (None, None)
        threads = args.torch_threads if args.torch_threads is not None or engine_cpus is None else len(engine_cpus)
        client: ModelClient = EngineProcessClient(args.model, torch_threads=threads, cpus=engine_cpus, **kwargs)
        if server_cpus is not None:
            bind_this_process(server_cpus)
            print(f"engine bound to CPUs {engine_cpus}, server to CPUs {server_cpus} (--engine-cpus none: no binding)",
                  file=sys.stderr, flush=True)
    else:
        client = make_client(spec, **kwargs)
    app = create_app(client, args.served_name or spec.model, default_max_tokens=args.max_tokens,
                     allow_weight_updates=args.allow_weight_updates, max_request_bytes=args.max_request_bytes,
                     max_tokens_cap=args.max_tokens_cap)
    print(f"serving {spec} as {args.served_name or spec.model!r} on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn_config(app, args.host, args.port, limits, log_level=args.log_level)).run()
    return 0
