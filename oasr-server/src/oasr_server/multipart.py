"""A small synchronous multipart/form-data parser (python-multipart underneath) so a large upload
is parsed in a worker thread instead of on the event loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParser, parse_options_header

from oasr.errors import InvalidRequestError

MAX_PARTS = 64
#: a text field (prompt, option) is small; bounds on what it may hold are in oasr.types
MAX_FIELD_BYTES = 64 * 1024


@dataclass
class UploadedFile:
    filename: str
    content_type: str
    data: bytes


@dataclass
class Form:
    fields: dict[str, list[str | UploadedFile]] = field(default_factory=dict)

    def get(self, name: str) -> str | UploadedFile | None:
        values = self.fields.get(name)
        return values[0] if values else None

    def getlist(self, name: str) -> list[str | UploadedFile]:
        return list(self.fields.get(name, ()))


def boundary_of(content_type: str) -> bytes:
    ctype, params = parse_options_header(content_type)
    if ctype != b"multipart/form-data":
        raise InvalidRequestError(
            "send the request as multipart/form-data with the audio in a 'file' field "
            f"(got Content-Type {content_type or 'none'!r})",
            param="file",
        )
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidRequestError("the multipart Content-Type has no boundary", param="file")
    return boundary


def parse_multipart(body: bytes, content_type: str) -> Form:
    """Parse a complete multipart body. Text parts become ``str``; parts with a filename become
    :class:`UploadedFile`. Malformed input raises :class:`InvalidRequestError`."""
    boundary = boundary_of(content_type)
    form = Form()
    state: dict = {"headers": {}, "field": b"", "value": b"", "chunks": [], "size": 0, "parts": 0}

    def on_part_begin() -> None:
        state["parts"] += 1
        if state["parts"] > MAX_PARTS:
            raise InvalidRequestError(f"the form has more than {MAX_PARTS} parts")
        state["headers"] = {}
        state["chunks"] = []
        state["size"] = 0

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["field"].lower()] = state["value"]
        state["field"] = state["value"] = b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        state["chunks"].append(data[start:end])
        state["size"] += end - start

    def on_part_end() -> None:
        disposition, params = parse_options_header(state["headers"].get(b"content-disposition"))
        if disposition != b"form-data" or b"name" not in params:
            raise InvalidRequestError("a multipart part has no Content-Disposition name")
        name = params[b"name"].decode("utf-8", "replace")
        data = b"".join(state["chunks"])
        value: str | UploadedFile
        if b"filename" in params:
            value = UploadedFile(
                filename=params[b"filename"].decode("utf-8", "replace"),
                content_type=state["headers"].get(b"content-type", b"").decode("latin-1"),
                data=data,
            )
        else:
            if len(data) > MAX_FIELD_BYTES:
                raise InvalidRequestError(
                    f"form field {name!r} is larger than {MAX_FIELD_BYTES} bytes", param=name
                )
            value = data.decode("utf-8", "replace")
        form.fields.setdefault(name, []).append(value)

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
        },
    )
    try:
        parser.write(body)
        parser.finalize()
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parser failure is the client's malformed body
        raise InvalidRequestError(
            f"could not parse the multipart body: {exc}", param="file"
        ) from None
    return form
