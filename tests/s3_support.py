"""A real S3-compatible server for the object-storage tests: moto's threaded server on 127.0.0.1,
started by the test itself (no network, no credentials of anyone's)."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow.fs as pafs

from flashx_batch import storage

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Start moto's S3 server; the environment points every client (pyarrow, boto3, subprocesses
    started meanwhile) at it. Yields the endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    storage.configure(None)
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        storage.configure(None)
        server.stop()


def make_bucket(name: str) -> str:
    import boto3

    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    return f"s3://{name}"


def upload(local: str | os.PathLike, uri: str) -> str:
    fs, path = storage.filesystem(uri)
    with open(local, "rb") as src, fs.open_output_stream(path) as dst:
        dst.write(src.read())
    return uri


def objects(uri: str) -> list[str]:
    """Every object under `uri`, relative to it."""
    fs, path = storage.filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    base = path.strip("/")  # fsspec-backed listings start with "/"
    return sorted(i.path.strip("/")[len(base) + 1:] for i in infos if i.type == pafs.FileType.File)


def output_ids(uri: str) -> tuple[Counter, Counter]:
    """(id counts of generations, of errors), read the way users read: `flashx_batch.read_output`."""
    from flashx_batch import read_output

    def ids(kind: str) -> Counter:
        table = read_output(uri, kind).to_table()
        return Counter(table.column("id").to_pylist()) if table.num_rows else Counter()

    return ids("generations"), ids("errors")


def job_record(uri: str) -> dict[str, Any]:
    import json

    return json.loads(storage.read_bytes(f"{uri}/job.json"))
