"""The one parser of JSON a client sends as an object: WebSocket frames (websocket.py, cartesia.py) and the
Cartesia HTTP bodies (cartesia_http.py). Anything but a JSON object is refused with an InvalidRequestError the
adapter sends in its own convention; a WebSocket connection stays open (ARCHITECTURE §7)."""

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
    return json_object(text)


def json_object(text: str | bytes, what: str = "message") -> dict[str, Any]:
    """The JSON object in `text` (bytes are UTF-8), or InvalidRequestError saying what is wrong with it;
    `what` names the text in the error ("message", "request body")."""
    try:
        # Bytes are UTF-8 (json.loads would guess UTF-16 or -32 from the first bytes).
        body = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"the {what} is not valid UTF-8 (offset {exc.start}); send JSON encoded as "
                                  "UTF-8") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{what} is not valid JSON: {exc.msg}") from None
    except RecursionError:  # "[" * 60000 fits in one message
        raise InvalidRequestError(f"{what} nests JSON arrays or objects too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts (4300)
        raise InvalidRequestError(f"{what} is not acceptable JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError(f"a {what} must be a JSON object")
    return body
