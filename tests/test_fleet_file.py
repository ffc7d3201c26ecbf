"""A fleet across hosts (issue 28 point 1): the fleet file (`kvbridge serve --fleet FILE --on HOST
--secret-file KEY`) is untrusted text, refused in one bounded line before anything starts; each
host's command runs exactly its own members, bound to its own address, and the router learns
every instance. No vLLM started (dry runs; the real two-host fleet is tests/vllm/test_vllm_two_hosts.py).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbridge.cli import app
from kvbridge.core.secrets import write_secret_file
from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.fleet_file import bind_address, read_fleet_file
from kvbridge.transport.ports import PortReservations

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm_tools = pytest.mark.skipif(not (VLLM_PYTHON.parent / "vllm-router").is_file(),
                                      reason="kvbridge serve --dry-run needs .venv-vllm's vllm and vllm-router")
runner = CliRunner()

GOOD = """\
[router]
host = "10.0.0.1"
port = 8000

[[instance]]
name = "prefill-0"
role = "prefill"
host = "10.0.0.1"
port = 8100
shape = "tp=1,block=64,transport=mooncake"

[[instance]]
name = "decode-0"
role = "decode"
host = "10.0.0.2"
port = 8100
side_channel_port = 8300
shape = "tp=2,block=32,transport=mooncake"
"""


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def test_a_fleet_file_names_every_instance_and_the_router(tmp_path):
    fleet = read_fleet_file(_file(tmp_path, GOOD))
    assert fleet.hosts == ["10.0.0.1", "10.0.0.2"] and fleet.router_url == "http://10.0.0.1:8000"
    prefill, decode = fleet.instances
    assert (prefill.role, prefill.url, prefill.ports) == ("prefill", "http://10.0.0.1:8100", [8100, 8101])
    assert (decode.shape.tp, decode.shape.block, decode.ports) == (2, 32, [8100, 8300, 8301])
    assert fleet.on("10.0.0.2") == [decode] and fleet.on("10.0.0.1") == [prefill]


def test_the_documented_example_is_a_valid_fleet_file(tmp_path):
    """docs/serving.md's two-host example parses as it is written."""
    text = (ROOT / "docs" / "serving.md").read_text()
    block = re.search(r"```toml\n(# fleet\.toml.*?)```", text, re.S)
    assert block, "docs/serving.md has no ```toml block starting '# fleet.toml'"
    fleet = read_fleet_file(_file(tmp_path, block.group(1)))
    assert {p.role for p in fleet.instances} == {"prefill", "decode"} and len(fleet.hosts) == 2
    commands = [shlex.split(line, comments=True) for line in re.findall(r"^kvbridge serve .*--fleet.*$", text, re.M)]
    assert {c[c.index("--on") + 1] for c in commands} == set(fleet.hosts)  # one command per host


@pytest.mark.parametrize("edit, why", [
    (lambda t: t.replace('role = "decode"', 'role = "both"'),
     r"Invalid enum value 'both' - at `\$.instance\[1\].role`"),
    (lambda t: t.replace("port = 8000", 'port = "x"'), r"Expected `int`, got `str` - at `\$.router.port`"),
    (lambda t: t.replace("port = 8000", "port = 70000"), r"<= 65535 - at `\$.router.port`"),
    (lambda t: t.replace("port = 8000", "port = 0"), r">= 1 - at `\$.router.port`"),
    (lambda t: t + "\nextra = 1\n", "unknown field `extra`"),
    (lambda t: t.replace('name = "decode-0"', 'name = "Decode_0"'),
     "matching regex .* - at `\\$.instance\\[1\\].name`"),
    (lambda t: t.replace('name = "decode-0"', 'name = "prefill-0"'), "'prefill-0' is given twice"),
    (lambda t: t.replace('name = "decode-0"', 'name = "router"'), "'router' is reserved"),
    (lambda t: t.replace('host = "10.0.0.2"', 'host = "0.0.0.0"'), "every interface, not an address"),
    (lambda t: t.replace('host = "10.0.0.2"', 'host = "a b"'), "matching regex .* - at `\\$.instance\\[1\\].host`"),
    (lambda t: t.replace('role = "decode"', 'role = "prefill"'), "0 decode instances"),
    (lambda t: t.replace("tp=2,block=32", "tp=2,block=5000"), "instance decode-0 shape .*block must be in 1..4096"),
    (lambda t: t.replace("transport=mooncake", "transport=shm"), "transport shm moves KV through one host's"),
    (lambda t: t.replace("side_channel_port = 8300", "side_channel_port = 65535"), "go past 65535"),
    (lambda t: t.replace("port = 8000", "port = 8101"), "10.0.0.1 port 8101 is both the router and instance "
                                                        "prefill-0's side-channel port"),
    (lambda t: t.replace("side_channel_port = 8300", "side_channel_port = 8099"), "port 8100 is both instance "
                                                                                  "decode-0's HTTP port and"),
    (lambda t: t.replace("[router]", "[routr]"), "unknown field `routr`"),
    (lambda t: "x = [", "fleet file .*: Invalid"),
    (lambda t: t + "\n" + "#" * (70 << 10), "larger than 65536 bytes"),
])
def test_a_bad_fleet_file_is_one_bounded_line_naming_it(tmp_path, edit, why):
    with pytest.raises(ConfigError, match=why) as e:
        read_fleet_file(_file(tmp_path, edit(GOOD)))
    message = str(e.value)
    assert "\n" not in message and len(message) < 400 and message.startswith("fleet file "), message


def test_the_shm_transport_is_fine_on_one_host(tmp_path):
    one_host = (GOOD.replace("10.0.0.2", "10.0.0.1").replace("port = 8100\nside_channel_port = 8300", "port = 8200")
                .replace("transport=mooncake", "transport=shm"))
    assert read_fleet_file(_file(tmp_path, one_host)).hosts == ["10.0.0.1"]


def test_a_missing_file_and_a_host_it_does_not_name_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="fleet file .*nope.toml: cannot read it"):
        read_fleet_file(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"--on 10.0.0.3: .* puts no member on it \(its hosts: 10.0.0.1, 10.0.0.2\)"):
        read_fleet_file(_file(tmp_path, GOOD)).on("10.0.0.3")


def test_a_member_binds_its_hosts_own_address():
    assert bind_address("10.0.0.2") == "10.0.0.2" and bind_address("::1") == "::1"
    assert bind_address("localhost") in ("127.0.0.1", "::1")  # a name (a pod's) resolved where it runs
    with pytest.raises(ConfigError, match="--on no-such-host.invalid: the name does not resolve here"):
        bind_address("no-such-host.invalid")


def _one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.output, r.output
    return lines[0]


@pytest.fixture()
def model(tmp_path):
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
    return add_byte_tokenizer(make_tiny_llama(tmp_path / "m", seed=1))


@pytest.mark.parametrize("args, why", [
    (["--on", "10.0.0.1"], "--on needs --fleet FILE"),
    (["--fleet", "FILE", "--on", "10.0.0.1", "--secret-file", "KEY", "--prefill", "tp=1"], "give no --prefill"),
    (["--fleet", "FILE", "--on", "10.0.0.1", "--secret-file", "KEY", "--port", "9000"], "give no --prefill"),
    (["--fleet", "FILE", "--secret-file", "KEY"], "--fleet needs --on HOST"),
    (["--fleet", "FILE", "--on", "10.0.0.1"], "--fleet needs --secret-file"),
    (["--fleet", "FILE", "--on", "10.0.0.9", "--secret-file", "KEY"], "--on 10.0.0.9: .* puts no member on it"),
])
def test_the_options_of_a_fleet_across_hosts_are_refused_in_one_line(tmp_path, model, args, why):
    path = _file(tmp_path, GOOD)
    key = tmp_path / "key"
    write_secret_file(key)
    args = [str(path) if a == "FILE" else str(key) if a == "KEY" else a for a in args]
    assert re.search(why, _one_error_line(runner.invoke(app, ["serve", str(model), *args])))


def test_the_fleets_secret_is_a_0600_file_of_16_bytes_or_more(tmp_path, model):
    from kvbridge.integrations.vllm.fleet_config import FleetConfig, check_shapes
    from kvbridge.integrations.vllm.fleet_file import place_here

    key = tmp_path / "key"
    for content, mode, why in ((b"x" * 32, 0o644, "--secret-file .*mode 0644 .*chmod 600"),
                               (b"short", 0o600, "--secret-file .*at least 16 bytes"), (None, 0, "no such file")):
        if content is not None:
            key.write_bytes(content)
            key.chmod(mode)
        elif key.exists():
            key.unlink()
        config = FleetConfig(model=model, prefill=[], decode=[], log_dir=tmp_path, secret_file=str(key),
                             fleet_file=read_fleet_file(_file(tmp_path, GOOD.replace("10.0.0.1", "127.0.0.1"))),
                             on="127.0.0.1")
        place_here(config)
        with pytest.raises(ConfigError, match=why) as e:
            check_shapes(config)
        assert "\n" not in str(e.value)


@needs_vllm_tools
def test_each_host_runs_its_own_members_on_its_own_address_and_the_router_learns_all(tmp_path, model):
    probe = PortReservations()
    base = probe.run(["127.0.0.1"] * 6)
    probe.release()
    text = (GOOD.replace("10.0.0.1", "127.0.0.1").replace("10.0.0.2", "127.0.0.2")
            .replace("port = 8000", f"port = {base}").replace("port = 8100", f"port = {base + 1}", 1)
            .replace("port = 8100", f"port = {base + 3}").replace("side_channel_port = 8300",
                                                                   f"side_channel_port = {base + 4}"))
    path = _file(tmp_path, text)
    key = tmp_path / "fleet.secret"
    write_secret_file(key)

    def dry_run(on: str) -> str:
        r = runner.invoke(app, ["serve", str(model), "--fleet", str(path), "--on", on, "--secret-file", str(key),
                                "--vllm-python", str(VLLM_PYTHON), "--dry-run"])
        assert r.exit_code == 0, r.output
        return r.output

    a, b = dry_run("127.0.0.1"), dry_run("127.0.0.2")
    assert re.findall(r"^# (\S+)", a, re.M) == ["prefill-0", "router"]
    assert re.findall(r"^# (\S+)", b, re.M) == ["decode-0"]  # the router runs on the other host
    assert f"--host 127.0.0.1 --port {base + 1} " in a and '"side_channel_host": "127.0.0.1"' in a
    assert f'"side_channel_port": {base + 2}' in a
    assert f"--host 127.0.0.2 --port {base + 3} " in b and '"side_channel_host": "127.0.0.2"' in b
    assert f'"side_channel_port": {base + 4}' in b and '"tensor-parallel-size"' not in b
    assert f"--host 127.0.0.1 --port {base} " in a  # the router, on its host's address
    assert f"--prefill http://127.0.0.1:{base + 1} --decode http://127.0.0.2:{base + 3}" in a
    assert a.count(f'"secret_file": "{key}"') == 1 and b.count(f'"secret_file": "{key}"') == 1
    assert key.exists() and os.stat(key).st_mode & 0o777 == 0o600  # read, never replaced or removed
