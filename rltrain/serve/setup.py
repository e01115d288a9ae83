"""How ``rltrain serve`` starts: the config, the base models it offers, Ray, the HTTP server; and
each model's learner config from the server's and the ``create_model`` request."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from rltrain.config import Config, ConfigError, load_config


def base_models(config: Config, out: Path) -> dict[str, str]:
    """Each of ``serve.base_models`` and its local folder (a built-in model built under ``out``)."""
    from rltrain.models.resolve import resolve_model

    folders = {}
    for name in config.serve.base_models:
        named = config.model_copy(update={"model": config.model.model_copy(update={"name_or_path": name})})
        folders[name] = resolve_model(named, out)
    return folders


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    """``rltrain serve --config FILE [key=value ...]``: serve until interrupted."""
    parser = argparse.ArgumentParser(prog="rltrain serve", description="the Tinker API on rltrain's learners")
    parser.add_argument("--config", help="YAML config file (configs/cpu_tinker.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. serve.port=8000")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        out = Path(config.run.output_dir).expanduser().resolve()
        out.mkdir(parents=True, exist_ok=True)
        folders = base_models(config, out)
        from rltrain.run.launch import connect_ray

        connect_ray(config, next(iter(folders.values())))
    except ConfigError as e:
        print(f"rltrain serve: config error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from rltrain.serve.app import make_app
    from rltrain.serve.server import Server

    port = config.serve.port or free_port(config.serve.host)
    app = make_app(Server(config, folders, out))
    print(f"rltrain serve: the Tinker API at http://{config.serve.host}:{port} (base models: "
          f"{', '.join(folders)}); outputs in {out}", flush=True)  # fmt: skip
    uvicorn.run(app, host=config.serve.host, port=port, log_level="warning")
    return 0
