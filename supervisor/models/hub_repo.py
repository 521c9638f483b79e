"""A model on the Hugging Face hub: what a name means, what the repo holds, what a pull takes.

`pull` and `/api/pull` accept `[hf.co/]ORG/NAME[:TAG][@REVISION]`: ORG/NAME is
the repo, TAG picks one GGUF file by its quantisation (`:Q4_K_M`, as
Ollama's `hf.co/...:TAG` names do; `:latest` means no tag), REVISION a
branch, tag or commit. A name is input from anywhere (a terminal, an HTTP
body), so it is checked here before it reaches a URL or a cache path: no
URL, no absolute or `..` path, no `--` (the cache's own separator), only
the characters the hub allows.

What may be pulled (`choose`): an MLX folder (`config.json` beside
`model*.safetensors`, what `mlx_lm.load` reads) or one GGUF file of a repo
(not a split one, not a vision projector). The weights' size once loaded is
known before any weight byte is fetched: a safetensors repo from the file
sizes the hub lists, a GGUF file from its header, read with Range requests
(K-quants are dequantized to float16 on import, so a GGUF's file size says
little about its size in memory: shared.gguf).

huggingface_hub does the talking (`HfApi.model_info` with file metadata);
the endpoint and the token come from the environment (`HF_ENDPOINT`,
`HF_TOKEN` or `hf auth login`), read at each call rather than at import, so
a long-running supervisor and the tests see what is set now.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Literal

import msgspec

from shared.gguf import GGUFError, read_header_from
from shared.sizes import MiB, format_size

DEFAULT_ENDPOINT = "https://huggingface.co"
LISTING_TIMEOUT = 30.0   # seconds for the hub's answer about a repo
GGUF_HEADER_LIMIT = 64 * MiB  # header bytes fetched before a pull; a larger header is sized by its file
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_REPO_RE = re.compile(rf"^{_NAME}/{_NAME}$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*(/[A-Za-z0-9][A-Za-z0-9._+-]*)*$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_PREFIXES = ("hf.co/", "huggingface.co/")
_SHARD_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
# A quantisation's name in a GGUF file name (`...-Q4_K_M.gguf`, `....IQ3_XS.gguf`, `-f16.gguf`).
_QUANT_RE = re.compile(r"(?i)(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|F16|BF16|F32)(?=\.gguf$|[-.])")
# The GGUF taken when the name gives no tag: Ollama's default first, then what keeps quality.
PREFERRED_QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "Q5_K_M", "Q6_K", "Q4_K_S", "Q5_0", "F16")
# Memory per parameter once imported (shared.gguf: Q4_0/Q4_1/Q8_0 stay quantized, with float16
# scales and biases per group of 32; BF16 is widened to float32; every other type becomes float16).
_BYTES_PER_PARAM = {"Q4_0": 5 / 8, "Q4_1": 5 / 8, "Q8_0": 9 / 8, "BF16": 4.0, "F32": 4.0}

Kind = Literal["mlx", "gguf"]


class RefError(ValueError):
    """A model name that cannot be pulled; the message says why and what is meant."""


class HubError(RuntimeError):
    """The hub refused or could not be reached; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ModelRef(msgspec.Struct, frozen=True, kw_only=True):
    """A checked name: the repo, the revision, and the GGUF the tag or `--file` picks."""

    repo: str
    revision: str = "main"
    tag: str = ""    # a GGUF quantisation named after ':' ("" = none)
    file: str = ""   # a GGUF file named outright (`pull --file`)

    @property
    def model_id(self) -> str:
        """The id it is served under: the name as pulled, without revision or `:latest`."""
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


def parse_ref(text: str, file: str = "") -> ModelRef:
    """`[hf.co/]ORG/NAME[:TAG][@REVISION]` checked, or RefError saying what is wrong."""
    name = text.strip()
    shown = repr(text[:80])
    if not name:
        raise RefError("a model name is required: ORG/NAME, e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    if "://" in name or name.lower().startswith("www."):
        raise RefError(f"{shown} is a URL: give the repo as ORG/NAME (what follows huggingface.co/)")
    if name.startswith(("/", "~", ".")) or "\\" in name or ".." in name:
        raise RefError(f"{shown} looks like a path: pull takes a hub repo ORG/NAME (to serve a folder "
                       "on disk, use serve --models-dir or [[models]])")
    for prefix in _PREFIXES:
        if name.lower().startswith(prefix):
            name = name[len(prefix):]
    name, _, revision = name.partition("@")
    repo, _, tag = name.partition(":")
    if tag.lower() == "latest":
        tag = ""
    if not _REPO_RE.match(repo) or "--" in repo:
        raise RefError(f"{shown} is not a hub repo: ORG/NAME, each of letters, digits, '.', '_' and '-' "
                       "(no '--'), e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    if tag and not _TAG_RE.match(tag):
        raise RefError(f"{shown}: the tag after ':' must be a quantisation such as Q4_K_M")
    if revision and (not _REVISION_RE.match(revision) or revision.endswith("/")):
        raise RefError(f"{shown}: the revision after '@' must be a branch, tag or commit")
    if file and (not _FILE_RE.match(file) or ".." in file or not file.endswith(".gguf")):
        raise RefError(f"--file {file[:80]!r}: a .gguf file's path inside the repo")
    if file and tag:
        raise RefError("give a tag (ORG/NAME:TAG) or --file, not both")
    return ModelRef(repo=repo, revision=revision or "main", tag=tag, file=file)


def quiet_transport_logs() -> None:
    """huggingface_hub's HTTP client (httpx2) logs each request at INFO, dozens a pull: kept
    at WARNING unless the log asks for DEBUG (`-v`)."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx2").setLevel(logging.WARNING)


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_cache() -> Path:
    """The hub cache huggingface_hub uses (`HF_HUB_CACHE`, else `$HF_HOME/hub`), read now."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home, "hub").expanduser()


class RepoFile(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    size: int
    sha256: str = ""  # the LFS object's digest, when the hub keeps the file in LFS


class Listing(msgspec.Struct, frozen=True, kw_only=True):
    """What the hub says a repo holds at one commit."""

    repo: str
    commit: str
    files: tuple[RepoFile, ...]

    def file(self, name: str) -> RepoFile | None:
        return next((f for f in self.files if f.name == name), None)


def fetch_listing(ref: ModelRef) -> Listing:
    """The repo's files and sizes at `ref.revision` (network: call it off the loop)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = hub_endpoint()
    try:
        info = HfApi(endpoint=endpoint).model_info(ref.repo, revision=ref.revision, files_metadata=True,
                                                   timeout=LISTING_TIMEOUT)
    except GatedRepoError:
        raise HubError(f"{ref.repo} is gated: accept its terms on the hub, then log in (`hf auth login`) "
                       "or set HF_TOKEN", 403) from None
    except RepositoryNotFoundError:
        raise HubError(f"no model {ref.repo} on {endpoint} (or it is private: log in with `hf auth login` "
                       "or set HF_TOKEN)", 404) from None
    except RevisionNotFoundError:
        raise HubError(f"{ref.repo} has no revision {ref.revision!r}", 404) from None
    except (OSError, ValueError) as exc:  # no network, offline mode, a server that is not a hub
        raise HubError(f"cannot read {ref.repo} from {endpoint}: {_first_line(exc)} (HF_ENDPOINT names "
                       "another hub or a mirror)", 502) from None
    return _checked_listing(ref.repo, info.sha, info.siblings or [], endpoint)


def _checked_listing(repo: str, commit: object, siblings: list, endpoint: str) -> Listing:
    """The hub's answer is input too: a commit hash, plain file names, sizes that are numbers."""
    if not isinstance(commit, str) or not _COMMIT_RE.match(commit):
        raise HubError(f"{endpoint} gave no commit for {repo}: is it a Hugging Face hub?", 502)
    files = []
    for s in siblings:
        size = s.size if s.size is not None else (s.lfs.size if s.lfs is not None else None)
        if not isinstance(size, int) or size < 0 or not _FILE_RE.match(s.rfilename) or ".." in s.rfilename:
            continue  # a file we would never fetch: skipped, not trusted
        sha = s.lfs.sha256 if s.lfs is not None and re.fullmatch(r"[0-9a-f]{64}", str(s.lfs.sha256)) else ""
        files.append(RepoFile(name=s.rfilename, size=size, sha256=sha))
    return Listing(repo=repo, commit=commit, files=tuple(files))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


# ---------------------------------------------------------------------------
# what a pull takes


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """One pull: the files to fetch and the weights' size once loaded (SPEC A2's estimate)."""

    ref: ModelRef
    kind: Kind
    commit: str
    files: tuple[RepoFile, ...]
    weight_bytes: int
    gguf: str = ""       # the GGUF file taken
    note: str = ""       # what was chosen, in words
    # the repo's other GGUF files: (name, bytes), their file sizes until `sized_gguf` estimates
    # each one's size once loaded from the parameter count of the one read
    others: tuple[tuple[str, int], ...] = ()

    @property
    def download_bytes(self) -> int:
        return sum(f.size for f in self.files)


# The small files an MLX folder needs beside its weights (top level only).
_MLX_SIDE_FILES = (".json", ".model", ".tiktoken", ".txt", ".jinja")


def choose(ref: ModelRef, listing: Listing) -> Plan:
    """The files to pull and what they weigh, or RefError when the repo holds nothing memvisor serves.
    A GGUF plan's weight bytes are its file size until `sized_gguf` reads its header."""
    ggufs = [f for f in listing.files if f.name.endswith(".gguf") and not _SHARD_RE.search(f.name)
             and "mmproj" not in f.name.lower()]
    top = [f for f in listing.files if "/" not in f.name]
    weights = [f for f in top if re.fullmatch(r"model.*\.safetensors", f.name)]
    mlx = bool(weights) and listing.file("config.json") is not None
    if ref.file or ref.tag or (ggufs and not mlx):
        chosen, note = _pick_gguf(ref, ggufs)
        others = tuple((f.name, f.size) for f in sorted(ggufs, key=lambda f: f.name) if f is not chosen)
        return Plan(ref=ref, kind="gguf", commit=listing.commit, files=(chosen,), weight_bytes=chosen.size,
                    gguf=chosen.name, note=note, others=others)
    if not mlx:
        raise RefError(f"{ref.repo} holds neither an MLX model (config.json beside model*.safetensors) nor a "
                       "single-file GGUF: memvisor can pull those two")
    files = tuple(f for f in top if f in weights or f.name.endswith(_MLX_SIDE_FILES))
    return Plan(ref=ref, kind="mlx", commit=listing.commit, files=files,
                weight_bytes=sum(f.size for f in weights),
                note=f"MLX model: {len(weights)} weight file(s), {len(files)} files in all")


def quant_of(name: str) -> str:
    """The quantisation a GGUF file's name carries (upper case), or ""."""
    found = _QUANT_RE.findall(Path(name).name)
    return found[-1].upper() if found else ""


def _pick_gguf(ref: ModelRef, ggufs: list[RepoFile]) -> tuple[RepoFile, str]:
    names = ", ".join(sorted(f.name for f in ggufs)[:20]) or "none"
    if ref.file:
        chosen = next((f for f in ggufs if f.name == ref.file), None)
        if chosen is None:
            raise RefError(f"{ref.repo} has no single-file GGUF {ref.file!r}; it has: {names}")
        return chosen, f"GGUF {chosen.name} (--file)"
    if ref.tag:
        matching = sorted((f for f in ggufs if quant_of(f.name) == ref.tag.upper()), key=lambda f: len(f.name))
        if not matching:
            tags = ", ".join(sorted({quant_of(f.name) for f in ggufs} - {""})) or "none"
            raise RefError(f"{ref.repo} has no GGUF tagged {ref.tag}; its tags: {tags}")
        extra = f" (of {len(matching)} with that tag: --file picks another)" if len(matching) > 1 else ""
        return matching[0], f"GGUF {matching[0].name} for tag {ref.tag}{extra}"
    if not ggufs:
        raise RefError(f"{ref.repo} has no single-file GGUF (split GGUF files are not served)")
    by_quant = {quant_of(f.name): f for f in sorted(ggufs, key=lambda f: len(f.name), reverse=True)}
    quant = next((q for q in PREFERRED_QUANTS if q in by_quant), "")
    chosen = by_quant[quant] if quant else sorted(ggufs, key=lambda f: f.name)[0]
    return chosen, (f"GGUF {chosen.name} (no tag given: took {quant or 'the first'} of {len(ggufs)}; "
                    f"ORG/NAME:TAG picks another)")


def sized_gguf(plan: Plan) -> Plan:
    """The GGUF plan with its weight bytes from the file's header (network: off the loop), and
    what the repo's other GGUF files would take. A header that cannot be read leaves the file's size."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    endpoint = hub_endpoint()
    file = plan.files[0]
    url = hf_hub_url(plan.ref.repo, file.name, revision=plan.commit, endpoint=endpoint)
    try:
        header = read_header_from(RangedFile(url, build_hf_headers(), min(file.size, GGUF_HEADER_LIMIT)),
                                  f"{plan.ref.repo}/{file.name}")
    except (GGUFError, OSError) as exc:
        return msgspec.structs.replace(plan, note=f"{plan.note}; sized by its file ({_first_line(exc)})")
    params = sum(t.elements for t in header.tensors)
    others = tuple((name, int(params * _BYTES_PER_PARAM.get(quant_of(name), 2.0))) for name, _ in plan.others)
    return msgspec.structs.replace(plan, weight_bytes=header.mlx_bytes, others=others)


class RangedFile:
    """Enough of a file object (read, tell) over a remote file, fetched in Range requests of a
    few MiB, never past `limit` bytes: the GGUF header parser reads it as it reads a local file."""

    BLOCK = 4 * MiB

    def __init__(self, url: str, headers: dict[str, str], limit: int) -> None:
        self.url, self.headers, self.limit = url, headers, limit
        self.buffer = bytearray()
        self.position = 0

    def tell(self) -> int:
        return self.position

    def read(self, n: int) -> bytes:
        end = min(self.position + n, self.limit)
        while len(self.buffer) < end:
            self._fetch(len(self.buffer), min(self.limit, len(self.buffer) + self.BLOCK) - 1)
        data = bytes(self.buffer[self.position:end])
        self.position += len(data)
        return data

    def _fetch(self, first: int, last: int) -> None:
        from huggingface_hub.utils import get_session

        wanted = last - first + 1
        headers = {**self.headers, "Range": f"bytes={first}-{last}", "Accept-Encoding": "identity"}
        with get_session().stream("GET", self.url, headers=headers, follow_redirects=True,
                                  timeout=LISTING_TIMEOUT) as response:
            if response.status_code != 206:
                raise OSError(f"the hub answered {response.status_code} to a Range request")
            got = bytearray()
            for chunk in response.iter_bytes():
                got += chunk[: wanted - len(got)]
                if len(got) >= wanted:
                    break
        if not got:
            raise OSError("the hub sent no bytes for a Range request")
        self.buffer += got


def describe(plan: Plan) -> str:
    """One line: what will be pulled and what it weighs."""
    return (f"{plan.ref.model_id}: {plan.note}; {format_size(plan.download_bytes)} to fetch, about "
            f"{format_size(plan.weight_bytes)} in memory once loaded")


def plan_for(ref: ModelRef) -> Plan:
    """What pulling `ref` takes, asked of the hub (network: off the loop). RefError, HubError."""
    plan = choose(ref, fetch_listing(ref))
    return sized_gguf(plan) if plan.kind == "gguf" else plan
