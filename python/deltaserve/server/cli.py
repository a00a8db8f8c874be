"""The `deltaserve` command: `generate` prints completions, `serve` runs the HTTP server.

Engine flags are derived from EngineConfig's fields, one flag per field (`page_size` ->
`--page-size`; a boolean that defaults to on, such as `enable_prefix_cache` or `cuda_graphs`,
becomes `--disable-prefix-cache` / `--disable-cuda-graphs`), so a new config field gets a flag
without touching this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import sys
from collections.abc import Sequence

from deltaserve.config import SPECULATIVE_ALGORITHMS, SPECULATIVE_POLICIES, EngineConfig
from deltaserve.server.cli_exit import OutputError, import_torch, interrupted, output_failed
from deltaserve.server.security import add_server_flags, server_options, warn_if_open

logger = logging.getLogger("deltaserve.server")

# fields set from other flags, never directly
_DERIVED = {"decode_rows_per_req"}
_HELP = {
    "model": "checkpoint folder (config.json + safetensors); default: the embedded model",
    "load_format": "auto (the checkpoint's safetensors) or dummy (random weights made on the "
                   "device from config.json alone, seeded by --seed: for benchmarks)",
    "dtype": "auto (bf16 on GPU, fp32 on CPU), bfloat16, float16 or float32",
    "device": "auto (cuda when available), cpu or cuda",
    "page_size": "KV positions per page",
    "chunk_size": "prefill tokens per request per step",
    "max_num_batched_tokens": "prefill tokens per step, all requests together",
    "max_running_reqs": "requests decoded together",
    "max_model_len": "context length (default: the model's max_position_embeddings)",
    "num_pages": "KV pages (default: sized from --kv-memory-gb)",
    "kv_memory_gb": "KV + snapshot memory budget in GiB when --num-pages is not given",
    "num_snapshot_slots": "device GDN snapshot slots (default: 2 x max running requests)",
    "host_snapshot_slots": "GDN snapshot slots in pinned host memory, where snapshots evicted "
                           "from the device go instead of being dropped (0: none; "
                           "each slot takes the bytes of one device slot)",
    "enable_prefix_cache": "turn the hybrid prefix cache off",
    "snapshot_grid": "GDN snapshot spacing in tokens (a multiple of 64)",
    "max_prompt_snapshots": "GDN snapshots per prompt taken at prefill chunk ends, kept evenly "
                            "spread (0: only the prompt's last grid boundary)",
    "fork_snapshots": "take no GDN snapshot where a prompt leaves a path the prefix cache "
                      "holds (a shared system prompt is then reused only at chunk ends)",
    "speculative_algorithm": "mtp or ngram",
    "speculative_num_steps": "drafts per verify step, 1..8 (0 or unset: 3; needs "
                             "--speculative-algorithm)",
    "speculative_policy": "fixed (every decode step verifies k drafts) or adaptive (each step "
                          "runs k drafts or a plain decode, whichever the measured step costs "
                          "and running acceptance say is faster)",
    "radix_lookahead": "key the prefix cache by each position's token and the token after it, "
                       "so a cached prefix also serves its MTP draft KV, which depends on that "
                       "next token (default: on exactly with --speculative-algorithm mtp)",
    "cuda_graphs": "run decode without CUDA graphs",
    "overlap_schedule": "build each decode step only after the previous step's tokens reached "
                        "the host (default: the next step is launched while the GPU runs the "
                        "current one, with CUDA graphs and no speculation)",
    "overlap_verify": "launch each MTP verify step before the previous one's accepted tokens "
                      "reach the host (greedy requests; needs --speculative-algorithm mtp, takes "
                      "effect with CUDA graphs; exact, but measured no faster yet: "
                      "benchmarks/RESULTS.md)",
    "tensor_parallel_size": "worker processes the model is sharded over (one per GPU; gloo on "
                            "a CPU); rank 0 schedules",
    "distributed_timeout_s": "seconds a tensor-parallel collective or rank may take before "
                             "the engine declares the rank dead",
    "mtp_cuda_graphs": "run the MTP proposer's catch-up and draft steps eagerly instead of "
                       "as CUDA graphs (needs --speculative-algorithm mtp)",
    "capture_graphs_at_start": "capture each CUDA graph when its batch size is first met "
                               "instead of all of them at start-up",
    "log_every": "log a step line every N steps (0: off)",
    "seed": "engine random seed",
}


def _flag(name: str, default: object) -> str:
    if default is True:
        return "--disable-" + name.removeprefix("enable_").replace("_", "-")
    return "--" + name.replace("_", "-")


def _value_type(annotation: str) -> type:
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if name in annotation.replace(" ", "").split("|"):
            return kind
    return str


def _port(text: str) -> int:
    try:
        port: int | None = int(text)
    except ValueError:
        port = None
    if port is None or not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be an integer in 0..65535, got {text!r}")
    return port


# fields with a closed set of values: --help lists them and argparse refuses others at once
_CHOICES = {"speculative_algorithm": SPECULATIVE_ALGORITHMS,
            "speculative_policy": SPECULATIVE_POLICIES}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field; unset flags keep the dataclass default."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _DERIVED:
            continue
        annotation = f.type if isinstance(f.type, str) else f.type.__name__
        kind, help_ = _value_type(annotation), _HELP.get(f.name, f.name.replace("_", " "))
        if kind is bool:
            action = "store_false" if f.default is True else "store_true"
            group.add_argument(_flag(f.name, f.default), dest=f.name, action=action,
                               default=argparse.SUPPRESS, help=help_)
        else:
            if "default" not in help_:
                help_ += f" (default: {f.default})"
            group.add_argument(_flag(f.name, f.default), dest=f.name, type=kind,
                               choices=_CHOICES.get(f.name), default=argparse.SUPPRESS,
                               help=help_)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags; `decode_rows_per_req` follows the speculation flags."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    cfg = EngineConfig(**{k: v for k, v in vars(args).items() if k in names})
    if "mtp_cuda_graphs" in vars(args) and cfg.speculative_algorithm != "mtp":
        raise ValueError("--disable-mtp-cuda-graphs needs --speculative-algorithm mtp")
    if cfg.overlap_verify and cfg.speculative_algorithm != "mtp":
        raise ValueError("--overlap-verify needs --speculative-algorithm mtp")
    try:
        cfg.validate()
        cfg.resolve_speculation()
    except ValueError as e:
        raise ValueError(_as_flag(str(e))) from None
    return cfg


def _as_flag(message: str) -> str:
    """A config error that opens with a field name ("page_size must be >= 1", "num_pages:
    ..."), opened with that field's flag instead, as the user typed it ("--page-size must be
    >= 1")."""
    head = message.split(" ", 1)[0].removesuffix(":")
    for f in dataclasses.fields(EngineConfig):
        if f.name == head and f.name not in _DERIVED:
            return _flag(f.name, f.default) + message[len(head):]
    return message


EXIT_STATUS = ("exit status: 0 done; 1 an error, in one line 'deltaserve: error: ...' (a flag "
               "value out of range, the checkpoint, the device, a prompt); 2 a usage error, "
               "with the usage line (an unknown flag, a value of the wrong type or not among "
               "a flag's choices, no prompt given); 130 interrupted (Ctrl-C); 141 generate's "
               "reader left (a closed pipe, as `| head`). serve: 0 "
               "after Ctrl-C's graceful shutdown; SIGTERM ends it by that signal after the "
               "same shutdown (status 143 in a shell)")
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature",
                  "top_p": "--top-p", "top_k": "--top-k",
                  "repetition_penalty": "--repetition-penalty"}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deltaserve")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev off: a mistyped flag ("--max-token") is a usage error, not another flag
    parser = argparse.ArgumentParser(prog="deltaserve", description=__doc__.split("\n")[0],
                                     epilog=EXIT_STATUS, allow_abbrev=False)
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="logging level (default INFO); also accepted after the command")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="print completions of the prompts (or stdin lines)",
                         epilog=EXIT_STATUS, allow_abbrev=False)
    gen.add_argument("prompts", nargs="*", metavar="PROMPT",
                     help="prompts; none: one prompt per line of standard input (blank lines "
                          "skipped)")
    gen.add_argument("--max-tokens", type=int, default=64,
                     help="new tokens per prompt, at most up to the context length (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0: greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, (0, 1]")
    gen.add_argument("--top-k", type=int, default=-1,
                     help="top-k sampling; -1 or 0: off (as in vLLM)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 1 penalises tokens already in the prompt or output (default 1: off)")
    gen.add_argument("--token-healing", action=argparse.BooleanOptionalAction, default=True,
                     help="back up the prompt's last token when it is whitespace that "
                          "longer tokens extend (a trailing newline: newline + indentation) "
                          "and make the first "
                          "token extend it; the output still continues the prompt exactly "
                          "(default on; not applied with --chat)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="keep generating past the end-of-sequence token, up to --max-tokens "
                          "(benchmarks)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message in the chat template")
    gen.set_defaults(command_parser=gen)
    add_engine_flags(gen)
    _add_log_level(gen)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           epilog=EXIT_STATUS, allow_abbrev=False)
    for command in (gen, serve):  # parse_args: an unknown flag shows the command's usage
        command.set_defaults(command_parser=command)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000,
                       help="TCP port, 0..65535 (0: any free port; default 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="model name in the API (default: the --model path, or "
                            "deltaserve-default for the embedded model)")
    add_server_flags(serve)
    add_engine_flags(serve)
    _add_log_level(serve)
    return parser


def _add_log_level(command: argparse.ArgumentParser) -> None:
    # SUPPRESS: when given only before the command, the subparser leaves that value alone
    command.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper,
                         choices=LOG_LEVELS, help="logging level (default INFO)")


def _make_engine(args: argparse.Namespace):
    """LLMEngine from the flags; a bad flag or checkpoint exits with one clear line, what
    config.json and the flags alone tell before the engine's modules and the weights load."""
    import_torch()
    from deltaserve.engine.preflight import check_config

    try:
        cfg = engine_config(args)
        check_config(cfg)
        from deltaserve.distributed import create_engine

        return create_engine(cfg)
    except ValueError as e:  # the engine's own checks name config fields too
        raise SystemExit(f"deltaserve: error: {_as_flag(str(e))}") from e


def stdin_prompts(data: bytes) -> list[str]:
    """`generate`'s prompts from standard input's bytes: one per line, blank lines skipped.
    Decoded as argv is (undecodable bytes kept as lone surrogates, which `_generate` reports
    with the prompt's number); lines end at "\n" only (a form feed stays in its line) and a
    CRLF file's "\r" is not part of its prompts."""
    text = data.decode("utf-8", "surrogateescape")
    return [line.removesuffix("\r") for line in text.split("\n") if line.strip()]


def _generate(args: argparse.Namespace) -> int:
    from deltaserve.core import SamplingParams

    prompts = args.prompts or stdin_prompts(sys.stdin.buffer.read())
    if not prompts:  # as a missing required argument: the usage line, exit status 2
        args.command_parser.error("no prompts given: pass PROMPT arguments or one prompt per "
                                  "line on standard input")
    for n, p in enumerate(prompts):  # before minutes of model loading
        if not p:
            raise SystemExit(f"deltaserve: error: prompt {n} is empty")
        try:  # undecodable argv / stdin bytes arrive as lone surrogates (surrogateescape)
            p.encode("utf-8")
        except UnicodeEncodeError as e:
            raise SystemExit(f"deltaserve: error: prompt {n} is not valid UTF-8 (byte "
                             f"{e.object[e.start].encode('utf-8', 'surrogateescape')!r} at "
                             f"character {e.start})") from None
    # the chat template's own last token ("\n" after the assistant tag) is not the user's
    try:  # before minutes of model loading, naming the flag
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos,
                                repetition_penalty=args.repetition_penalty,
                                token_healing=args.token_healing and not args.chat)
    except ValueError as e:
        field, _, rest = str(e).partition(" ")
        raise SystemExit(f"deltaserve: error: {SAMPLING_FLAGS.get(field, field)} {rest}") from e
    engine = _make_engine(args)
    try:
        return _run_generate(engine, args, prompts, params)
    finally:
        close = getattr(engine, "close", None)  # tensor parallel: stop the worker processes
        if close is not None:
            close()


def _run_generate(engine, args: argparse.Namespace, prompts: list[str], params) -> int:
    tok = engine.tokenizer
    if tok is None:
        raise SystemExit("deltaserve: error: the model has no tokenizer (tokenizer.json or "
                         "tokenizer_config.json in the checkpoint folder)")
    if args.chat:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True) for p in prompts]
        ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    else:
        ids = [tok.encode(p) for p in prompts]
    try:
        rids = [engine.add_request(i, params) for i in ids]
    except ValueError as e:  # prompt over the context limit
        raise SystemExit(f"deltaserve: error: {e}") from e
    cut = [n for n, i in enumerate(ids) if len(i) + params.max_tokens > engine.max_model_len]
    if cut:  # the server refuses such a request; here the context length bounds the output
        print(f"deltaserve: warning: --max-tokens {params.max_tokens} does not fit the context "
              f"length {engine.max_model_len} for {len(cut)} prompt(s): they stop at the "
              f"context length", file=sys.stderr)
    texts = {rid: "" for rid in rids}
    live = len(rids) == 1  # a single prompt streams to stdout as it is generated
    try:
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.rid] += out.new_text
                if live:
                    print(out.new_text, end="", flush=True)
        if live:
            print(flush=True)
            return 0
        for n, (prompt, rid) in enumerate(zip(prompts, rids, strict=True)):
            print(f"=== [{n}] {prompt}\n{texts[rid]}")
        sys.stdout.flush()
    except OSError as e:  # stdout closed (`| head`) or full: not the engine's error
        raise OutputError(e) from e
    return 0


def _check_listen(host: str, port: int) -> None:
    """Raise ValueError when `host`:`port` cannot be bound now (address in use, no such
    address). The socket is closed at once: the server binds it again after loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError as e:
        raise ValueError(f"--host / --port: cannot listen on {host}:{port}: {e}") from e


def _serve(args: argparse.Namespace) -> int:
    import_torch()  # before the server's modules, which import it
    import uvicorn

    from deltaserve.server.api import build_app
    from deltaserve.server.async_engine import AsyncEngine
    from deltaserve.server.shutdown import SHUTDOWN_GRACE_S, graceful_server

    # bad values and the port before minutes of loading; the no-key warning only for a
    # server that can listen
    options = server_options(args, warn=False)
    _check_listen(args.host, args.port)
    warn_if_open(args.host, options)
    engine = AsyncEngine(_make_engine(args), model_name=args.served_model_name)
    try:
        app = build_app(engine, options)
        logger.info("serving %s", engine.model_name)
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=args.log_level.lower(),
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        try:
            graceful_server(config, engine).run()
        except KeyboardInterrupt:  # uvicorn re-raises the signal it handled (uvicorn.run too)
            pass
    finally:
        engine.shutdown()
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """build_parser's parse, where an unknown flag is its command's usage error (argparse
    would print the top-level usage, which lists no flag of the command). Exits 2 on it."""
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _generate(args) if args.command == "generate" else _serve(args)
    except (ValueError, FileNotFoundError) as e:  # bad flags, checkpoint or device: one line
        print(f"deltaserve: error: {_as_flag(str(e))}", file=sys.stderr)
        return 1  # as SystemExit(message) gives; 2 stays argparse's usage errors
    except OutputError as e:
        return output_failed(e)
    except KeyboardInterrupt:  # Ctrl-C during loading or generate: no traceback
        return interrupted()


if __name__ == "__main__":
    sys.exit(main())
