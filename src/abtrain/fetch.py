"""``abtrain data fetch``: download a dataset's files from their canonical location, checksums verified.

Fashion-MNIST is four IDX ``.gz`` files, published by Zalando Research in the
dataset's GitHub repository and on its S3 website. Each file is checked by the
SHA-256 of its *uncompressed* bytes, so the check holds for the published
archives (whose MD5s the dataset's README lists) and for re-compressed copies
such as Debian's ``dataset-fashion-mnist`` alike. A file is written under a
temporary name and renamed only once it is complete and verified, so an
interrupted or refused download never leaves half a file under the real name.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

from .data import user_data_dir
from .run.safefile import NoSpaceError, atomic_write

__all__ = ["FASHION_MNIST", "FASHION_URLS", "FetchError", "fetch_fashion_mnist", "file_ok", "user_data_dir"]

#: SHA-256 of each file's uncompressed content. Debian's package re-compressed the archives (its
#: ``.gz`` bytes differ from the published ones), but the content is the same: these digests, taken from
#: Debian's files, match the ones other projects derive from the published archives.
FASHION_MNIST: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte.gz": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte.gz": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte.gz": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
# What a dead or missing network raises (urllib wraps the connection's errors; reads raise them bare).
_NETWORK_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, socket.timeout)

#: The canonical locations, tried in this order (the S3 website serves plain http only; the checksums
#: make the transport's integrity irrelevant).
FASHION_URLS = (
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
)
URL_ENV = "ABTRAIN_FASHION_MNIST_URL"
TIMEOUT = 30.0  # seconds without a byte before a download is given up
_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A download failed: no network, the server refused, or the file's checksum is wrong."""


def _content_sha256(chunks: Callable[[], bytes]) -> str:
    """SHA-256 of the uncompressed bytes of a gzip stream (or of the bytes, when not gzip)."""
    digest = hashlib.sha256()
    first = chunks()
    inflate = zlib.decompressobj(wbits=31) if first[:2] == b"\x1f\x8b" else None
    chunk = first
    while chunk:
        digest.update(inflate.decompress(chunk) if inflate is not None else chunk)
        if inflate is not None and inflate.eof and inflate.unused_data:
            raise zlib.error("more than one gzip member")
        chunk = chunks()
    if inflate is not None:
        if not inflate.eof:
            raise zlib.error("the gzip stream is truncated")
        digest.update(inflate.flush())
    return digest.hexdigest()


def file_ok(path: Path, sha256: str) -> bool:
    """True when ``path`` exists and its uncompressed content has the expected SHA-256."""
    try:
        with open(path, "rb") as fh:
            return _content_sha256(lambda: fh.read(_CHUNK)) == sha256
    except (OSError, zlib.error):
        return False


def _download(url: str, fh: BinaryIO, sha256: str) -> None:
    """Stream ``url`` into ``fh``, checking the content's SHA-256 on the way."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
            def read() -> bytes:
                chunk = response.read(_CHUNK)
                fh.write(chunk)
                return chunk
            got = _content_sha256(read)
    except zlib.error as exc:
        raise FetchError(f"{url}: corrupt gzip data ({exc}); the server sent a damaged file") from None
    if got != sha256:
        raise FetchError(f"{url}: checksum mismatch (SHA-256 of the content {got}, expected {sha256}); "
                         f"the file was not kept")


def _why(exc: BaseException) -> str:
    reason = getattr(exc, "reason", exc)
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(reason, socket.gaierror):
        return f"the host name does not resolve ({reason.strerror})"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no answer within {TIMEOUT:g} s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    return str(getattr(reason, "strerror", None) or reason)


def fetch_fashion_mnist(data_dir: str | os.PathLike | None = None, base_url: str | None = None,
                        checksums: Mapping[str, str] = FASHION_MNIST,
                        say: Callable[[str], None] = print) -> Path:
    """Download the four Fashion-MNIST files into ``data_dir`` (default: the user data dir's
    ``fashion-mnist``) and return that directory. Files already there and valid are kept.

    ``base_url`` (default ``$ABTRAIN_FASHION_MNIST_URL``, else the canonical locations) is a
    directory URL the file names are appended to; ``file://`` works too.
    """
    target = Path(data_dir) if data_dir is not None else user_data_dir() / "fashion-mnist"
    base_url = base_url or os.environ.get(URL_ENV) or None
    bases = (base_url,) if base_url else FASHION_URLS
    for base in bases:
        if urllib.parse.urlsplit(base).scheme not in ("http", "https", "file"):
            raise ValueError(f"base URL {base!r} must start with http://, https:// or file://")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the data directory {target}: {exc.strerror}; "
                         f"pass --data-dir with a writable directory") from None
    for name, sha256 in checksums.items():
        path = target / name
        if file_ok(path, sha256):
            say(f"{path}: present, checksum ok")
            continue
        errors = []
        for base in bases:
            url = base.rstrip("/") + "/" + name
            try:
                atomic_write(str(path), lambda fh: _download(url, fh, sha256))
                break
            except _NETWORK_ERRORS as exc:
                errors.append(f"{url}: {_why(exc)}")
            except NoSpaceError as exc:
                raise FetchError(f"{exc}; free space and fetch again") from None
            except OSError as exc:  # this machine's side: the data directory
                raise ValueError(f"cannot write {path}: {exc.strerror or exc}; pass --data-dir with a "
                                 f"writable directory") from None
        else:
            raise FetchError(f"cannot download {name} (" + "; ".join(errors) + "): offline? Check the network, "
                             f"set {URL_ENV} (or --base-url) to a reachable copy, or place the four files "
                             f"in {target} yourself")
        say(f"{path}: downloaded, checksum ok")
    return target
