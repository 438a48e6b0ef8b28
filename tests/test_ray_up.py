"""``ray up deploy/ray/local.yaml`` for real against this machine: Ray's local provider reaches
127.0.0.1 through a private sshd, rsyncs the repo, runs the file's setup and start commands, and
``radixray serve`` answers a request; ``ray down`` then stops it all.

Slow (about two minutes, one of them waiting for serve to exit after ``ray down``) and
disruptive: the file's start commands run ``ray stop``, which kills every Ray process on the
machine, so run it on its own, after the rest of the suite (``pytest -m slow``, as ``.ci/run``
does).

What is machine-specific, and so differs from ``local.yaml``:
- ``auth``: this user and a throwaway key. Ray's schema has no ssh port, so instead of a daemon on
  a port, ssh's ProxyCommand runs ``sshd -i`` (one inetd-style session per connection) with a
  config in a temp dir; the system's sshd and its config are never touched.
- The login environment: sshd sets ``HOME`` to a temp dir, whose ``.bashrc`` puts a virtualenv
  first on ``PATH``. The virtualenv sees this Python's packages (``--system-site-packages``), so
  ``pip install torch`` is already satisfied, and ``pip install ~/radixray`` installs the rsynced
  copy into the virtualenv, never over the editable install of the developer's checkout.
- ``pip install ~/radixray`` gets ``--no-deps --no-build-isolation`` (the dependencies are
  installed already: no downloads), and ``radixray serve`` a free port and a small KV pool.
Everything else (file_mounts, rsync_exclude, the order of the commands, ``ray stop``,
``ray start --head``, ``--host 0.0.0.0 --ray-address auto``) runs as written.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from helpers import processes_using

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
LOCAL_YAML = REPO / "deploy" / "ray" / "local.yaml"
SSHD = shutil.which("sshd", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin",
                                                   "/usr/local/sbin", "/sbin"]))
MISSING = [name for name, path in [("ssh", shutil.which("ssh")), ("sshd", SSHD),
                                   ("rsync", shutil.which("rsync")),
                                   ("ssh-keygen", shutil.which("ssh-keygen"))] if path is None]
MAX_NEW_TOKENS = 6


def free_port() -> int:
    """A port that is free, and whose successor (the replica's port) is free too."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("", port + 1))
            except OSError:
                continue
            return port


def ray_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """This Python's ``ray`` command, run from the repo root (file_mounts copy ".")."""
    return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def make_login(tmp: Path) -> tuple[dict, Path]:
    """Key, sshd config, temp HOME and virtualenv; returns the ``auth`` section and HOME."""
    for name in ("key", "host_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / name)],
                       check=True)
    shutil.copy(tmp / "key.pub", tmp / "authorized_keys")
    home, venv = tmp / "home", tmp / "venv"
    home.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=300)
    # pip gives the virtualenv no `ray` script (ray lives in the system site-packages).
    (venv / "bin" / "ray").write_text(f"#!{venv}/bin/python\nimport sys\n"
                                      "from ray.scripts.scripts import main\nsys.exit(main())\n")
    (venv / "bin" / "ray").chmod(0o755)
    # Ray runs every remote command as `bash --login -c -i 'source ~/.bashrc; ...'`.
    (home / ".bashrc").write_text(f'export PATH="{venv}/bin:$PATH"\n')
    (tmp / "sshd_config").write_text(f"""\
HostKey {tmp}/host_key
AuthorizedKeysFile {tmp}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
SetEnv HOME={home} RAY_USAGE_STATS_ENABLED=0
""")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    auth = {"ssh_user": getpass.getuser(), "ssh_private_key": str(tmp / "key"),
            "ssh_proxy_command": f"{SSHD} -i -f {tmp}/sshd_config"}
    return auth, home


def cluster_config(auth: dict, port: int) -> dict:
    """local.yaml with this machine's auth, a no-download radixray install and a free port."""
    cfg = yaml.safe_load(LOCAL_YAML.read_text())
    assert cfg["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    cfg["auth"] = auth

    def replace(commands, old, new):
        matches = [i for i, c in enumerate(commands) if old in c]
        assert len(matches) == 1, f"{old!r} not once in {commands}"
        commands[matches[0]] = commands[matches[0]].replace(old, new)

    replace(cfg["setup_commands"], "pip install ~/radixray",
            "pip install --no-deps --no-build-isolation ~/radixray")
    replace(cfg["head_start_ray_commands"], "--port 30000",
            f"--port {port} --max-total-tokens 1024")
    return cfg


def wait_until_healthy(url: str, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:  # serve was started in the background; it needs a while to load
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no serve log"
        time.sleep(2)


def assert_generates(url: str) -> None:
    r = httpx.post(f"{url}/generate", timeout=120, json={
        "text": "def main():", "sampling_params": {
            "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == MAX_NEW_TOKENS


@pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (.ci/run installs "
                    "openssh-server and rsync)")
@pytest.mark.skipif(os.geteuid() != 0, reason="sshd -i must run as root to log a user in")
def test_ray_up_serves_a_request_and_ray_down_stops_it(tmp_path):
    auth, home = make_login(tmp_path)
    venv, port = tmp_path / "venv", free_port()
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(cluster_config(auth, port), sort_keys=False))
    url, log = f"http://127.0.0.1:{port}", home / "radixray-serve.log"
    try:
        up = ray_cli("up", "-y", "--no-config-cache", str(cluster), timeout=900)
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        # file_mounts copied the repo, and serve runs from the copy installed into the venv.
        assert (home / "radixray" / "pyproject.toml").is_file()
        assert not (home / "radixray" / ".git").exists()  # rsync_exclude
        assert list(venv.glob("lib/python*/site-packages/radixray/__init__.py"))
        assert len(processes_using(str(venv), "bin/radixray serve")) == 1
        wait_until_healthy(url, log)
        assert_generates(url)
    finally:
        down = ray_cli("down", "-y", str(cluster), timeout=300)
        # Ray ends serve (a driver) about 60 s after its cluster stops, and the router with it.
        deadline = time.monotonic() + 150
        while (leftover := processes_using(str(venv))) and time.monotonic() < deadline:
            time.sleep(2)
        if leftover:  # clean up for the next run; the test fails below
            ray_cli("stop", "--force", timeout=120)
            for pid in processes_using(str(venv)):  # only what this test started: its venv's
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert down.returncode == 0, down.stdout[-4000:] + down.stderr[-4000:]
    assert not leftover, (f"still running 150 s after `ray down`: {sorted(leftover)}\n"
                          + down.stdout[-4000:] + down.stderr[-4000:])
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=5)
