"""Machines for the cluster launcher, made on this one: each host is a network namespace on a
bridge (its own address, reached over real TCP), a PID namespace (its own process table, so a
`ray stop` there stops that host's Ray alone, and killing the host kills everything on it, as a
machine that dies), its own hostname, home directory and /tmp/ray, and an SSH server, the way
`ray up` reaches a team's own machines. The filesystem is otherwise shared, so the hosts see the
checkout's virtual environment and one directory for run storage (the NFS mount of a real
cluster).

Needs root, iproute2's `ip netns`, util-linux's `unshare`, OpenSSH's server and rsync (the
launcher's file mounts); `require()` installs the last two with apt-get where they are missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.0"          # the bridge is .254, hosts .1, .2, ...
BRIDGE = "sy-bridge"


def require() -> str | None:
    """Why these hosts cannot be made here, or None; installs sshd and rsync where missing."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} is not installed"
    if not (Path("/usr/sbin/sshd").exists() and shutil.which("rsync")):
        if not shutil.which("apt-get"):
            return "openssh-server and rsync are missing and there is no apt-get to install them"
        install = subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                                 "openssh-server rsync", shell=True, capture_output=True, text=True, timeout=600)
        if install.returncode != 0:
            return f"apt-get could not install openssh-server and rsync: {install.stderr[-500:]}"
    probe = subprocess.run(["ip", "netns", "add", "sy-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"this machine refuses network namespaces: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "sy-probe"], check=True)
    return None


def run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str
    ip: str
    root: Path                      # this host's own files: home, /tmp/ray, sshd's log
    sshd: subprocess.Popen | None = None

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def ray_tmp(self) -> Path:
        return self.root / "ray"

    def start(self, keys: Path, hosts_file: Path) -> None:
        """The host's SSH server, first process of the host's own PID namespace. `hosts_file` is
        the cluster's name service: every host's name resolves to its address on the bridge, as a
        cluster's DNS does (gloo binds to the address its own hostname resolves to)."""
        for folder in (self.home, self.ray_tmp):
            folder.mkdir(parents=True, exist_ok=True)
        config = self.root / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {self.ip}:22", f"HostKey {keys / 'host_key'}",
            f"AuthorizedKeysFile {keys / 'client_key.pub'}", "PermitRootLogin prohibit-password",
            "StrictModes no", "UsePAM no", "PidFile none", ""]))
        # This host's own /etc/passwd, naming its home as root's: sshd and ssh read the home
        # directory from there, not from $HOME (ssh expands `-i ~/ray_bootstrap_key.pem` with it).
        passwd = self.root / "passwd"
        passwd.write_text("".join(self.homed(line) for line in Path("/etc/passwd").read_text().splitlines(True)))
        inside = (f"hostname {self.name} && mount --bind {passwd} /etc/passwd && "
                  f"mount --bind {hosts_file} /etc/hosts && mkdir -p /tmp/ray && "
                  f"mount --bind {self.ray_tmp} /tmp/ray && exec /usr/sbin/sshd -D -e -f {config}")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        self.sshd = subprocess.Popen(
            ["ip", "netns", "exec", self.name, "unshare", "--pid", "--fork", "--kill-child", "--mount",
             "--mount-proc", "--uts", "--propagation", "private", "sh", "-c", inside],
            stdout=(self.root / "sshd.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.listening():
            if self.sshd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {self.name} did not start: {(self.root / 'sshd.log').read_text()}")
            time.sleep(0.1)

    def homed(self, line: str) -> str:
        fields = line.split(":")
        if fields[0] == "root":
            fields[5] = str(self.home)
        return ":".join(fields)

    def listening(self) -> bool:
        try:
            socket.create_connection((self.ip, 22), timeout=1).close()
            return True
        except OSError:
            return False

    def power_off(self) -> None:
        """The machine dies: its first process is killed, and the kernel kills every other process
        in its PID namespace (Ray's raylet, workers and all) at once, with no chance to clean up."""
        if self.sshd and self.sshd.poll() is None:
            self.sshd.kill()
            self.sshd.wait(timeout=30)

    def processes(self, pattern: str) -> list[str]:
        """Command lines on this host matching `pattern` (read inside its PID namespace)."""
        if not self.sshd or self.sshd.poll() is not None:
            return []
        found = subprocess.run(["nsenter", f"--target={self.first_pid()}", "--pid", "--mount",
                                "pgrep", "-af", pattern], capture_output=True, text=True)
        return found.stdout.splitlines()

    def first_pid(self) -> int:
        """The host's first process (sshd), as this machine numbers it."""
        children = Path(f"/proc/{self.sshd.pid}/task/{self.sshd.pid}/children").read_text().split()
        return int(children[0])


class Hosts:
    """`count` hosts on one bridge, with one SSH key pair for the client; `with Hosts(...)`
    removes them, their namespaces and the bridge at the end."""

    def __init__(self, root: Path, count: int) -> None:
        self.root = root
        self.keys = root / "keys"
        self.hosts = [Host(f"sy-host{i}", f"{SUBNET}.{i}", root / f"host{i}") for i in range(1, count + 1)]

    @property
    def client_key(self) -> Path:
        return self.keys / "client_key"

    def __enter__(self) -> list[Host]:
        self.remove()  # what an interrupted earlier run left
        self.keys.mkdir(parents=True)
        for key in ("client_key", "host_key"):
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.keys / key))
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")
        hosts_file = self.root / "hosts"
        hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{h.ip} {h.name}\n" for h in self.hosts))
        for i, host in enumerate(self.hosts, start=1):
            run("ip", "netns", "add", host.name)
            run("ip", "link", "add", f"sy-veth{i}", "type", "veth", "peer", "name", "eth0", "netns", host.name)
            run("ip", "link", "set", f"sy-veth{i}", "master", BRIDGE, "up")
            run("ip", "-n", host.name, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            run("ip", "-n", host.name, "link", "set", "eth0", "up")
            run("ip", "-n", host.name, "link", "set", "lo", "up")
            # A default route, as a real machine has: Ray finds its node's address by the route out.
            run("ip", "-n", host.name, "route", "add", "default", "via", f"{SUBNET}.254")
            host.start(self.keys, hosts_file)
        return self.hosts

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts:
            host.power_off()
        self.remove()

    def remove(self) -> None:
        for i, host in enumerate(self.hosts, start=1):
            pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout.split()
            subprocess.run(["kill", "-9", *pids], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
            subprocess.run(["ip", "link", "del", f"sy-veth{i}"], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
