"""Stored responses (``store: true``): what ``previous_response_id`` continues from and
``GET``/``DELETE /v1/responses/{id}`` read, in this ingress replica's memory.

In memory per ingress rather than in Ray's object store: a response is small (text), a follow-up
is read within seconds of its answer, and keeping Ray out of the request path keeps this
deployable behind the same ingress code everywhere. The cost, stated: a deployment with several
ingress replicas finds a stored response only on the replica that made it (a follow-up elsewhere
is a 404 that says so), and a restarted ingress forgets them all. Bounded by count and by
characters, the oldest dropped first; each entry belongs to the tenant (or key-less caller) that
stored it, and no one else can read, continue or delete it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from deployments.errors import ServingError

MAX_STORED_RESPONSES = 4096
MAX_STORED_CHARS = 64 << 20
"""About 64 MiB of response and conversation text (JSON characters) per ingress replica."""


class ResponseNotFound(ServingError):
    http_status = 404
    openai_type = "invalid_request_error"


@dataclass(frozen=True)
class Stored:
    owner: str | None
    response: dict
    """The response object, as ``GET`` returns it."""
    conversation: tuple[dict, ...]
    """The chat messages a follow-up continues from: this response's input (after what it
    continued) and its output, without its instructions."""
    chars: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str | None, response: dict, conversation: list[dict]) -> None:
        chars = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        if chars > self.max_chars:
            return  # larger than the whole store: kept by no one, as a full store keeps its newest
        self.delete_any(response["id"])
        self._entries[response["id"]] = Stored(owner, response, tuple(conversation), chars)
        self._chars += chars
        while len(self._entries) > self.max_responses or self._chars > self.max_chars:
            _, dropped = self._entries.popitem(last=False)
            self._chars -= dropped.chars

    def get(self, owner: str | None, response_id: str, param: str = "response_id") -> Stored:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:  # another tenant's: as if it did not exist
            raise ResponseNotFound(
                f"response {response_id!r} is not stored here: responses are kept (with store: true) in the memory "
                f"of the ingress replica that made them, at most {self.max_responses} of them, oldest dropped first",
                param=param)
        self._entries.move_to_end(response_id)  # a conversation in use stays
        return entry

    def delete(self, owner: str | None, response_id: str) -> None:
        self.get(owner, response_id)
        self.delete_any(response_id)

    def delete_any(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars -= entry.chars
