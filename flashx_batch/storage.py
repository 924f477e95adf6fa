"""Where input and output live: local paths and object-store URIs (`s3://`, `gs://`, `hdfs://`), opened
through `pyarrow.fs`; any other scheme (`oss://`, `abfs://`, ...) through fsspec where it is installed.

Who calls it: `data.readers` (input files), `runner.layout` / `runner.object_layout` (the output
directory), `flashx_batch.read_output`. The job's `storage.*` keys are installed once per process
(`configure`: the driver from its config, every worker from its `WorkerContext`) and every URI is
opened with them; where a key is unset, pyarrow reads the usual environment and config files
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_ENDPOINT_URL`,
`AWS_DEFAULT_REGION`, `~/.aws/credentials`; `GOOGLE_APPLICATION_CREDENTIALS`; Hadoop's
`CLASSPATH` / `HADOOP_HOME`). Secrets are never logged: `StorageSettings.__repr__` masks them and
job.json records them masked.

An S3-compatible store (MinIO, Alibaba OSS, Ceph RGW) is `s3://` with `storage.endpoint_url` (or
`AWS_ENDPOINT_URL`). Conditional puts (`If-None-Match: *`, the commit point on object stores) go
through boto3 where it is installed; without it the commit protocol falls back to its deterministic
tie-break (runner/object_layout.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from flashx_batch.errors import ConfigError

log = logging.getLogger(__name__)
_SECRETS = ("secret_access_key", "session_token")


@dataclass(frozen=True)
class StorageSettings:
    """The job's `storage.*` keys: how to reach an object store. Unset = pyarrow's own defaults (the
    environment, config files, instance metadata)."""

    endpoint_url: str | None = None  # an S3-compatible store (MinIO, OSS, ...): http(s)://host:port
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    anonymous: bool = False  # public buckets: no credentials at all
    # commit manifests with `If-None-Match: *` where the store honours it (S3, recent MinIO); false for a
    # store that accepts the header but ignores it (the commit protocol's tie-break decides then)
    conditional_put: bool = True
    # the run lock on an object store: a lease object renewed every third of this; a driver that dies
    # without releasing it blocks other hosts for at most this long (the same host takes over at once)
    lease_ttl_s: float = 60.0

    def __repr__(self) -> str:  # never print a secret, whoever logs the settings
        shown = {f.name: ("***" if f.name in _SECRETS and getattr(self, f.name) else getattr(self, f.name))
                 for f in dataclasses.fields(self)}
        return "StorageSettings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def masked(self) -> dict[str, Any]:
        """The settings as job.json records them: secrets replaced by '***'."""
        return {f.name: ("***" if f.name in _SECRETS and getattr(self, f.name) else getattr(self, f.name))
                for f in dataclasses.fields(self)}


_settings = StorageSettings()
_cache: dict[tuple[str, str], Any] = {}  # filesystems (and the boto3 client) by scheme and bucket
_lock = threading.Lock()


def configure(settings: StorageSettings | None) -> None:
    """Install the job's storage settings for this process (filesystems opened before are dropped)."""
    global _settings
    with _lock:
        _settings = settings or StorageSettings()
        _cache.clear()


def settings() -> StorageSettings:
    return _settings


def scheme_of(path: str) -> str | None:
    """'s3' for 's3://bucket/key', None for a local path (Windows drive letters are not schemes)."""
    parsed = urlparse(path)
    if len(parsed.scheme) > 1 and "://" in path:
        return parsed.scheme.lower()
    return None


def normalize(uri: str) -> str:
    """A remote URI in its one spelling: empty path components and `.` dropped, `..` resolved, at most
    one trailing slash (kept: it says "a directory"); local paths, `file://` and `bundled://` as given.
    Every reader, writer, lease and manifest name a job builds derives from the configured paths, so
    normalising them once (`config.validate`) gives one key per object: a lease written through one
    client under `./out/_lease.json` and read back through another as `out/_lease.json` once made
    every run see "another run" (exit 75, retried forever). ConfigError for an object-store URI that
    names no bucket, or any that climbs above its root (`hdfs:///path`: the default namenode, kept)."""
    scheme = scheme_of(uri)
    if scheme in (None, "file", "bundled"):
        return uri
    parsed = urlparse(uri)
    if not parsed.netloc and _bucket_style(scheme):  # hdfs:///path: the default namenode
        raise ConfigError(f"{uri}: no bucket after {scheme}://; write {scheme}://<bucket>/<path>.")
    parts: list[str] = []
    for part in parsed.path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise ConfigError(f"{uri}: '..' climbs above the root of {scheme}://{parsed.netloc}; write the path "
                                  "without it.")
            parts.pop()
            continue
        parts.append(part)
    path = "/".join(parts) + ("/" if parts and parsed.path.endswith("/") else "")
    tail = (f"?{parsed.query}" if parsed.query else "") + (f"#{parsed.fragment}" if parsed.fragment else "")
    return f"{scheme}://{parsed.netloc}/{path}{tail}" if path else f"{scheme}://{parsed.netloc}{tail}"


def is_remote(path: str) -> bool:
    """Any URI but file:// (and bundled://, which the config resolves to a local path first)."""
    return scheme_of(path) not in (None, "file", "bundled")


def _bucket_style(scheme: str) -> bool:
    """Paths inside the filesystem are `bucket/key` (object stores) rather than `/path` (hdfs)."""
    return scheme not in ("hdfs", "viewfs")


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path, `file://` or a remote URI; ConfigError for a
    scheme we cannot open (with what would open it)."""
    scheme = scheme_of(uri)
    if scheme is None:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    if scheme == "file":
        return pafs.LocalFileSystem(), urlparse(uri).path
    parsed = urlparse(uri)
    key = (scheme, parsed.netloc)
    with _lock:
        fs = _cache.get(key)
        if fs is None:
            fs = _cache[key] = _open(scheme, uri)
    if _bucket_style(scheme):
        return fs, (parsed.netloc + parsed.path).rstrip("/")
    return fs, parsed.path.rstrip("/") or "/"


def _open(scheme: str, uri: str) -> pafs.FileSystem:
    s = _settings
    try:
        if scheme == "s3":
            kwargs: dict[str, Any] = {}
            endpoint = _s3_endpoint()
            if endpoint:
                parsed = urlparse(endpoint)
                kwargs["endpoint_override"] = parsed.netloc or parsed.path
                if parsed.scheme:
                    kwargs["scheme"] = parsed.scheme
            if s.region:
                kwargs["region"] = s.region
            if s.anonymous:
                kwargs["anonymous"] = True
            elif s.access_key_id or s.secret_access_key:
                if not (s.access_key_id and s.secret_access_key):
                    raise ConfigError("storage.access_key_id and storage.secret_access_key go together; set both, "
                                      "or neither (the environment's credentials are used then).")
                kwargs.update(access_key=s.access_key_id, secret_key=s.secret_access_key,
                              session_token=s.session_token)
            return pafs.S3FileSystem(**kwargs)
        if scheme in ("gs", "gcs"):
            return pafs.GcsFileSystem(anonymous=s.anonymous) if s.anonymous else pafs.FileSystem.from_uri(uri)[0]
        if scheme in ("hdfs", "viewfs"):
            return pafs.FileSystem.from_uri(uri)[0]  # libhdfs from HADOOP_HOME and CLASSPATH
        return _fsspec(scheme, uri)
    except ConfigError:
        raise
    except Exception as exc:  # pyarrow built without the filesystem, libhdfs missing, bad endpoint
        raise ConfigError(f"{uri}: cannot open the {scheme}:// filesystem ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); check storage.* and the credentials "
                          "in the environment.") from None


def _fsspec(scheme: str, uri: str) -> pafs.FileSystem:
    """A scheme pyarrow has no filesystem for (oss://, abfs://, az://, memory://, ...) through fsspec,
    when fsspec and the scheme's implementation (ossfs, adlfs, ...) are installed."""
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"{uri}: pyarrow has no {scheme}:// filesystem and fsspec is not installed; use s3:// "
                          "(with storage.endpoint_url for S3-compatible stores), gs:// or hdfs://, or install "
                          f"fsspec with the package that implements {scheme}://.") from None
    try:
        return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem(scheme)))
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"{uri}: no filesystem for {scheme}:// ({exc}); use s3://, gs:// or hdfs://, or install "
                          f"the fsspec package that implements {scheme}://.") from None


def glob_files(pattern: str) -> list[tuple[str, pafs.FileInfo]]:
    """Files matching a remote glob (`*`, `?`, `[..]` in any component, `**` for any depth), sorted:
    the listing under the pattern's fixed prefix, filtered by fnmatch component by component."""
    parts = pattern.split("/")
    fixed = []
    for p in parts:
        if any(ch in p for ch in "*?["):
            break
        fixed.append(p)
    return [(uri, info) for uri, info in list_files("/".join(fixed)) if glob_match(parts, uri.split("/"))]


def glob_match(pattern: Sequence[str], path: Sequence[str]) -> bool:
    """glob semantics on path components: `**` any number of directories, each other part fnmatch'ed."""
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(glob_match(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], head) and glob_match(rest, path[1:])


def list_files(uri: str) -> list[tuple[str, pafs.FileInfo]]:
    """Every file under a remote directory (prefix), recursively, sorted, as (uri, info)."""
    scheme = scheme_of(uri)
    fs, path = filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    prefix = f"{scheme}://" if _bucket_style(scheme) else f"{scheme}://{urlparse(uri).netloc}"
    return sorted(((prefix + _inner(i.path, scheme), i) for i in infos if i.type == pafs.FileType.File),
                  key=lambda x: x[0])


def _inner(path: str, scheme: str | None) -> str:
    """A listed path as `filesystem` returns paths: `bucket/key` (fsspec listings add a leading "/")."""
    return path.lstrip("/") if scheme is not None and _bucket_style(scheme) else path


def file_info(uri: str) -> pafs.FileInfo:
    fs, path = filesystem(uri)
    return fs.get_file_info(path)


def read_bytes(uri: str) -> bytes:
    """A whole object; FileNotFoundError if it is not there."""
    fs, path = filesystem(uri)
    with fs.open_input_stream(path) as fh:
        return fh.read()


def put_if_absent(uri: str, data: bytes) -> bool | None:
    """Create the object only if no object has that name: True if created, False if one was there,
    None where the store offers no conditional put to us (then the caller breaks ties itself).
    S3 (and S3-compatible stores that honour `If-None-Match: *`) through boto3, when installed."""
    if scheme_of(uri) != "s3" or not _settings.conditional_put:
        return None
    try:
        import boto3
        from botocore.exceptions import ClientError
    except ImportError:
        return None
    parsed = urlparse(uri)
    client = _s3_client(boto3)
    try:
        client.put_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"), Body=data, IfNoneMatch="*")
        return True
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return False
        if code in ("NotImplemented", "InvalidArgument") or status == 501:
            return None  # a store that ignores or refuses the header
        raise


def _s3_client(boto3: Any) -> Any:
    """One boto3 S3 client per process and settings (building one costs tens of milliseconds)."""
    with _lock:
        client = _cache.get(("boto3", "s3"))
        if client is None:
            s = _settings
            endpoint = _s3_endpoint()
            kwargs: dict[str, Any] = {"endpoint_url": endpoint} if endpoint else {}
            if s.region:
                kwargs["region_name"] = s.region
            if s.access_key_id and s.secret_access_key:
                kwargs.update(aws_access_key_id=s.access_key_id, aws_secret_access_key=s.secret_access_key,
                              aws_session_token=s.session_token)
            client = _cache[("boto3", "s3")] = boto3.client("s3", **kwargs)
        return client


def _s3_endpoint() -> str | None:
    """An S3-compatible store's endpoint: `storage.endpoint_url`, else the AWS environment's."""
    return _settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
