"""The `kvbridge` command: one module per subcommand (plan, demo, prefill-server, serve, verify, bench)."""

from kvbridge.cli import bench, demo, plan, serve, server, verify  # noqa: F401  (each registers its command)
from kvbridge.cli.app import app, load_spec

__all__ = ["app", "load_spec"]


def main() -> None:  # pragma: no cover
    app()
