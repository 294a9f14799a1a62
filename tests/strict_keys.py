"""Scripts that refuse to touch a key they were not given in KEYS: every key a script touches must be
declared, as Redis Cluster and the Redis docs require (Redis itself only checks that the declared keys share
a slot).

``strict_keys`` (a fixture) loads the store's scripts with each ``redis.call(`` routed through a check: a
command's first argument must be one of the script's KEYS (PUBLISH's is a channel). A script that builds a
key name fails its call with "undeclared key".
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from macpool.store import api, scripts

CHECK = """local checked_call
do
  local declared = {}
  for _, key in ipairs(KEYS) do declared[key] = true end
  checked_call = function(command, key, ...)
    if string.upper(command) ~= 'PUBLISH' and not declared[key] then
      error('undeclared key ' .. tostring(key) .. ' in ' .. command)
    end
    return redis.call(command, key, ...)
  end
end
"""


def checked(name: str) -> str:
    """``name``.lua with every Redis call checked."""
    return CHECK + scripts.source(name).replace("redis.call(", "checked_call(")


@pytest.fixture
def strict_keys(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(api, "source", checked)
    yield
