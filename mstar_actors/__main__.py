"""The command line: ``python -m mstar_actors serve CONFIG``, ``fetch NAME`` and ``dump-stacks [RUN]``."""

from __future__ import annotations

import argparse
import logging
import sys

from mstar_actors import dump_stacks, early_stop


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mstar_actors", description=__doc__.replace("``", ""))
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the model and adapters a config names")
    serve.add_argument("config", help="a serving YAML, e.g. configs/smollm2.yaml")
    serve.add_argument("--host", help="overrides server.host")
    serve.add_argument("--port", type=int, help="overrides server.port")
    serve.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="every actor's log level (default INFO; DEBUG adds a line a step)")
    fetch = commands.add_parser("fetch", help="fetch and convert an embedded model once")
    fetch.add_argument("name", help="an embedded model name, e.g. smollm2")
    dump = commands.add_parser("dump-stacks", help="print every actor's thread and task stacks of a running server")
    dump_stacks.add_arguments(dump)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from mstar_actors import launcher
    from mstar_actors.config import ConfigError, load_config
    from mstar_actors.fetch import FetchError
    from mstar_actors.model_info import check_model_files, load_model_info
    from mstar_actors.models.spec import ModelLoadError
    from mstar_actors.runner.parallel import check_rank_devices
    from mstar_actors.speech.snac_codec import CodecLoadError, check_folder

    server = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    try:
        config = load_config(args.config, server=server)
        actors = [plan.name for plan in launcher.plan_actors(config.parallel.tp, config.server.api_server_count)]
        if unknown := [name for name in config.debug.profile_actors if name not in actors]:
            raise ConfigError(f"debug.profile_actors: {', '.join(map(repr, unknown))} is no actor of this server; "
                              f"its actors: {', '.join(actors)}")
        check_rank_devices(config.parallel.tp, config.model.device)
        info = load_model_info(config)
        check_model_files(info.model_dir)
        if config.speech.snac_path:
            check_folder(config.speech.snac_path)
    except ModelLoadError as err:  # the folder model.path names
        print(f"error: model.path: {err}", file=sys.stderr)  # (the message names the folder)
        return 2
    except (ConfigError, FetchError, CodecLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    log = logging.getLogger("mstar_actors")
    _log_what_is_served(log, config, info)
    if info.sampling_defaults:  # as vLLM says it: a request's defaults are no longer OpenAI's
        log.info("requests that leave them out take the model's generation_config.json defaults: %s "
                 "(model.generation_config: none for OpenAI's)",
                 ", ".join(f"{name} {value}" for name, value in info.sampling_defaults.items()))
    return launcher.serve(config, info)


def _log_what_is_served(log: logging.Logger, config, info) -> None:
    """The start's account of what it serves, in two lines, as vLLM's engine-config line gives it."""
    from mstar_actors.runner.device import resolve_device

    model, sched = config.model, config.scheduler
    device = resolve_device(model.device).type
    log.info("serving %s from %s: %s, %s on %s (model.quantization %s), tp %d, up to %d sequences of %d tokens",
             info.served_name, info.model_dir, info.architecture, info.dtype, device, model.quantization,
             config.parallel.tp, sched.max_num_seqs, info.max_model_len)
    lora = config.lora
    if lora.adapters or lora.allow_runtime_updates:
        log.info("LoRA: %s; %d slots of rank up to %d; runtime loads and unloads %s",
                 ", ".join(f"{name} ({path})" for name, path in lora.adapters.items()) or "no adapter at start",
                 lora.max_loras, lora.max_lora_rank,
                 f"on (from {', '.join(lora.adapter_dirs)})" if lora.allow_runtime_updates and lora.adapter_dirs
                 else "on" if lora.allow_runtime_updates else "off (lora.allow_runtime_updates)")


def _fetch(args: argparse.Namespace) -> int:
    from mstar_actors.fetch import FetchError, fetch_embedded

    try:
        print(fetch_embedded(args.name))
    except FetchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # what it had made is removed on the way out
        print(f"interrupted: {args.name} is not fetched; run the command again", file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        early_stop.catch()  # before the slow imports: a signal there stops the start quietly
    level = getattr(args, "log_level", "INFO")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s [launcher] %(name)s: %(message)s")
    if args.command == "dump-stacks":
        return dump_stacks.run(args)
    return _serve(args) if args.command == "serve" else _fetch(args)


if __name__ == "__main__":
    sys.exit(main())
