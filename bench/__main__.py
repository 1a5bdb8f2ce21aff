"""``python -m bench overhead|engine|gpu|profile|...``."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

COMMANDS = {
    "overhead": ("bench.overhead", "Flatfare's full path vs LiteLLM's proxy, instant engine (~8 min)"),
    "engine": ("bench.engine", "Flatfare vs `vllm serve`, same model and engine options, on this CPU (~10 min)"),
    "gpu": ("bench.gpu", "the same comparison on the lent H200: prepare, device driver, report"),
    "profile": ("bench.profile", "py-spy profiles of the gateway and worker under the overhead load (~1 min)"),
    "faults": ("bench.faults", "kill, stop and break the platform's parts under load: lost, charged twice, "
               "counters vs ledger vs outbox (~16 min, 8 of them the real CPU engine's row)"),
    "scheduling": ("bench.scheduling", "premium TTFT under others' 2x overload, a noisy neighbour's flood against "
                   "nine accounts, prefix routing vs sharing (~12 min)"),
    "capabilities": ("bench.capabilities", "tools, reasoning and vision through catalog entries on random-weight "
                     "real architectures (the H200: gpu_device.sh capabilities)"),
    "console": ("bench.console", "the usage pages' database work on 10,000 accounts and 1,000,000 ledger rows, "
                "SQLite and PostgreSQL (~5 min)"),
    "fleet": ("bench.fleet", "many models on one engine budget: cold starts, wakes, the budget held, nothing lost "
              "(cpu ~10 min; gpu: the H200, gpu_device.sh fleet; report)"),
    "batch": ("bench.batch", "the live lanes' TTFT with and without a batch running on the batch lane, instant "
              "engine (~3 min)"),
    "rehearsal": ("bench.rehearsal", "a production trace through the whole platform on mixed plans, beside `vllm "
                  "serve`: Premium, fair shares, batches, two models, the money audit (GPU: gpu_device.sh rehearsal)"),
    "soak": ("bench.soak", "an hour at 70 % of capacity with restarts, batches and key rotations: RSS, file "
             "descriptors, tasks, Redis, connections and p99 per window, the money audit (~62 min)"),
    "scale": ("bench.scale", "requests/s for 1, 2, 4 worker hosts, hosts as network namespaces; needs root (~3 min)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description="Flatfare's benchmarks; results go to "
                                     "bench/results/ (Markdown, CSV, PNG).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__.splitlines()[0]))
    return parser


def exit_on_termination() -> None:
    """SIGTERM and SIGHUP (``timeout``, a closed terminal) end the benchmark as Ctrl-C does: by an exception,
    so its ``finally`` blocks stop what it started. Python's default for both ends the process at once, and
    the platforms a benchmark starts (each child in a session of its own) ran on as orphans."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    exit_on_termination()
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
