"""Regenerate ``speech_pb2.py`` / ``speech_pb2_grpc.py`` from ``proto/oasr/speech/v1/speech.proto``:

    python -m oasr_server.grpc_api.generate

(needs grpcio-tools). The generated modules are committed so the server needs only grpcio and
protobuf at run time; the import in the service module is made relative, because the proto's
package path (``oasr/speech/v1``) is not a Python package here.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE / "proto"
PROTO = "oasr/speech/v1/speech.proto"


def main() -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            PROTO,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out = Path(tmp) / "oasr" / "speech" / "v1"
        (HERE / "speech_pb2.py").write_text((out / "speech_pb2.py").read_text())
        grpc_src = (out / "speech_pb2_grpc.py").read_text()
        grpc_src = re.sub(
            r"^from oasr\.speech\.v1 import speech_pb2 as",
            "from . import speech_pb2 as",
            grpc_src,
            flags=re.M,
        )
        (HERE / "speech_pb2_grpc.py").write_text(grpc_src)
    print(f"wrote {HERE / 'speech_pb2.py'} and {HERE / 'speech_pb2_grpc.py'}")


if __name__ == "__main__":
    main()
