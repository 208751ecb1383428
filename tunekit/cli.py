"""The `tunekit` command's entry point: reads its arguments (`tunekit.arguments`, where each subcommand and its
options are listed) and runs the subcommand (`tunekit.commands`), owning the process's signals while it does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from tunekit import commands
from tunekit.arguments import COMMANDS, make_parser, unknown_arguments
from tunekit.commands import Stopped, say_error
from tunekit.config import ConfigError
from tunekit.presets import resolve


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def apply_environment() -> None:
    """What the environment sets for this process, read once by the entry point that owns it (the library never
    reads it at import): TUNEKIT_LORA_BMM=0 computes fused LoRA's FP8 products as plain matmuls
    (`fastlora.LORA_BMM`), to time both in one session; TUNEKIT_BF16_BMM=1 computes its bf16 products as
    batch-of-one `bmm`s (`fastlora.BF16_BMM`); TUNEKIT_FP8_FAST_ACCUM=0 makes the FP8 input gradient's matmul
    accumulate at full precision (`fastlora.FAST_ACCUM_BACKWARD`; =1, the default, fast);
    TUNEKIT_COMPILE_MODE=reduce-overhead (or another of torch.compile's modes) compiles the step in that mode
    (`speedups.COMPILE_MODE`)."""
    if mode := os.environ.get("TUNEKIT_COMPILE_MODE"):
        from tunekit import speedups

        if mode not in speedups.COMPILE_MODES:
            raise SystemExit(f"tunekit: TUNEKIT_COMPILE_MODE={mode!r}: choose one of {', '.join(speedups.COMPILE_MODES)}")
        speedups.COMPILE_MODE = mode
    bmm, bf16, fast = (os.environ.get(f"TUNEKIT_{k}") for k in ("LORA_BMM", "BF16_BMM", "FP8_FAST_ACCUM"))
    if bmm is not None or bf16 is not None or fast is not None:
        from tunekit import fastlora

        if bmm is not None:  # each switch only where its variable is set: the others keep the library's defaults
            fastlora.LORA_BMM = bmm != "0"
        if bf16 is not None:
            fastlora.BF16_BMM = bf16 == "1"
        if fast is not None:
            fastlora.FAST_ACCUM_BACKWARD = fast != "0"


def main(argv: list[str] | None = None) -> int:
    # The entry point owns the process: SIGTERM and SIGHUP stop as Ctrl-C does from the first line on (left
    # to their default they kill it at once, during torch's import as anywhere). `train` catches all three
    # once it has started, to finish the step; the handlers are put back on the way out.
    old = {}
    commands.RECEIVED.clear()  # this call's signals only (a script may call main more than once)
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s}
    try:
        apply_environment()
        return _main(argv)
    except KeyboardInterrupt as e:  # before (or after) a command's own handling
        name, code = commands.signal_name(e)
        say_error(f"tunekit: interrupted by {name}")
        return code
    finally:  # a run launched by torchrun leaves its process group cleanly
        for s, h in old.items():
            signal.signal(s, h)
        if (dist := sys.modules.get("tunekit.distributed")) is not None:
            dist.teardown()


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser()
    args, rest = parser.parse_known_args(argv)
    takes_fields = COMMANDS[args.command].preset is not None
    if msg := unknown_arguments(parser.commands[args.command], rest, takes_fields):
        print(f"tunekit {args.command}: error: {msg}", file=sys.stderr)
        return 2
    if args.command == "train":
        return commands.train(args, rest, argv)
    if args.command in ("export", "generate"):
        return commands.export(args)
    try:
        cfg = resolve(args.preset, rest) if takes_fields else None
        return commands.RUN[args.command](args, cfg, rest) or 0
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"tunekit {args.command}: error: {e}", file=sys.stderr)
        return 2


def leave(code: int) -> None:
    """Exit with `code`. A process of a launch on CPUs (gloo) leaves without the interpreter's exit, once its
    group is torn down: there torch's and gloo's C++ teardown now and then aborted a rank whose work was done
    and written (SIGABRT, "terminate called without an active exception", no Python frame left; 1 launch in
    21 to 44 on a busy 2-core machine), and torchrun then reported the whole launch as failed. Everything else
    exits as usual."""
    from tunekit import distributed

    if distributed.started_gloo() and not distributed.dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # `python -m tunekit.cli`, as torchrun and accelerate launch it
    leave(main())
