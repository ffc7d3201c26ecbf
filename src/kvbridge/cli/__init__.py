"""The `kvbridge` command: one module per subcommand (plan, demo, prefill-server, verify, bench)."""

from kvbridge.cli import bench, demo, plan, server, verify  # noqa: F401  (each registers its command)
from kvbridge.cli.app import app, load_spec

__all__ = ["app", "load_spec"]


def main() -> None:  # pragma: no cover
    app()
