"""gRPC API ``oasr.speech.v1.Speech`` (plus the standard health and reflection services).

``speech_pb2`` / ``speech_pb2_grpc`` are generated from ``proto/oasr/speech/v1/speech.proto``
by ``python -m oasr_server.grpc_api.generate``. Nothing here is imported unless the server is
started with ``--grpc-bind``.
"""
