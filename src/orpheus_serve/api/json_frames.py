"""The one parser of JSON WebSocket frames (websocket.py, cartesia.py): a frame is a JSON object in a text
message, or it is refused with an InvalidRequestError the adapter sends in its own convention, and the
connection stays open (ARCHITECTURE §7)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..request.errors import InvalidRequestError


def json_object_frame(message: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON object an ASGI `websocket.receive` message carries as text. InvalidRequestError for a binary
    frame, text that is not JSON (or that Python will not parse: nesting too deep, an integer of more
    digits than it converts), or a JSON value that is not an object."""
    text = message.get("text")
    if text is None:
        raise InvalidRequestError("binary messages are not accepted; send requests as JSON text messages")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"message is not valid JSON: {exc.msg}") from None
    except RecursionError:  # "[" * 60000 fits in one message
        raise InvalidRequestError("message nests JSON arrays or objects too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts (4300)
        raise InvalidRequestError(f"message is not acceptable JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("a message must be a JSON object")
    return body
