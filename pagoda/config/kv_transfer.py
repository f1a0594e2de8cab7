"""What a request and an instance say about KV transfer (no torch: SamplingParams and
EngineConfig import this).

A request's ``kv_transfer_params`` (vLLM's field name, our own keys) is one of:

- ``{"do_remote_decode": true, "transfer_id": "X"}`` to a prefill instance: compute the
  prompt, sample the first token, then keep the KV blocks parked under X until a decode
  instance fetches them (or the router releases them, or ``timeout_s`` passes);
- ``{"do_remote_prefill": true, "transfer_id": "X", "remote_address": "tcp://host:port"}`` to
  a decode instance: fetch X's blocks and first token from the prefill instance's KV endpoint,
  then decode on. ``"prompt_token_ids": [...]`` (optional, vLLM's key) are the prompt's tokens as
  the prefill instance computed them: the decode instance takes them as the prompt instead of
  rendering the request's own (the router passes them on), so another tokenizer or template
  there cannot disagree.

An instance's ``--kv-transfer-config`` (JSON) sets its KV endpoint and limits; see
``KVTransferConfig``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from pagoda.json_options import json_object

KV_ROLES = ("prefill", "decode")
TRANSPORTS = ("auto", "shm", "tcp")
DEFAULT_TIMEOUT_S = 30.0

_TRANSFER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_TCP_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})")


def check_tcp_address(name: str, value: Any) -> str:
    """``tcp://host:port`` (an IPv6 host in brackets), else ValueError naming ``name``."""
    m = _TCP_ADDRESS.fullmatch(value) if isinstance(value, str) else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"{name} must be tcp://host:port, got {value!r}")
    return value


@dataclass
class KVTransferParams:
    """A request's part in a prefill-decode transfer (see the module docstring)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str | None = None
    remote_address: str | None = None
    prompt_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("do_remote_decode", "do_remote_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kv_transfer_params.{name} must be a bool, got {getattr(self, name)!r}")
        if self.do_remote_decode == self.do_remote_prefill:
            raise ValueError("kv_transfer_params must set exactly one of do_remote_decode (to a prefill "
                             "instance) and do_remote_prefill (to a decode instance)")
        if not isinstance(self.transfer_id, str) or not _TRANSFER_ID.fullmatch(self.transfer_id):
            raise ValueError("kv_transfer_params.transfer_id must be 1-128 characters of letters, digits and "
                             f"._:-, got {self.transfer_id!r}")
        if self.do_remote_prefill:
            check_tcp_address("kv_transfer_params.remote_address", self.remote_address)
        elif self.remote_address is not None:
            raise ValueError("kv_transfer_params.remote_address is the prefill instance's KV endpoint, given to "
                             "a decode instance (do_remote_prefill); a prefill instance takes none")
        ids = self.prompt_token_ids
        if ids is not None:
            if not self.do_remote_prefill:
                raise ValueError("kv_transfer_params.prompt_token_ids are the prefill instance's prompt, given to a "
                                 "decode instance (do_remote_prefill); a prefill instance computes its own")
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise ValueError("kv_transfer_params.prompt_token_ids must be a non-empty list of token ids "
                                 "(non-negative integers)")

    @classmethod
    def parse(cls, value: Any) -> KVTransferParams | None:
        """None, a KVTransferParams or a dict of its fields (unknown keys refused)."""
        if value is None or isinstance(value, KVTransferParams):
            return value
        return cls(**json_object("kv_transfer_params", value, (f.name for f in fields(cls))))


@dataclass(frozen=True)
class KVTransferConfig:
    """``--kv-transfer-config``, e.g. ``{"host": "10.0.0.5", "port": 7100}`` on a prefill
    instance, ``{"transport": "tcp"}`` on a decode instance.

    Prefill instance (it serves its parked blocks on a ZMQ endpoint):
      ``host``           the address the KV endpoint binds (default 127.0.0.1; 0.0.0.0 for all)
      ``port``           its port (default 0: one the OS picks; /v1/kv_transfer/info tells it)
      ``advertise_host`` the host decode instances reach it by (default: ``host``, or this
                         machine's name when ``host`` is 0.0.0.0)
    Decode instance:
      ``transport``      how the blocks travel: ``shm`` (a file in /dev/shm, one host only),
                         ``tcp`` (in the endpoint's messages, any hosts) or ``auto`` (default:
                         shm when both instances run on one machine, else tcp)
    Both:
      ``timeout_s``      prefill: parked blocks no decode instance fetched in this time are
                         freed; decode: a fetch unanswered for this long fails (default 30)
    """

    role: str
    transport: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv_transfer_config: transport must be one of {', '.join(TRANSPORTS)}, "
                             f"got {self.transport!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"kv_transfer_config: port must be an integer in [0, 65535], got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"kv_transfer_config: host must be a host name or address, got {self.host!r}")
        if self.advertise_host is not None and (not isinstance(self.advertise_host, str) or not self.advertise_host):
            raise ValueError(f"kv_transfer_config: advertise_host must be a host name, got {self.advertise_host!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"kv_transfer_config: timeout_s must be a number > 0, got {self.timeout_s!r}")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))

    @classmethod
    def parse(cls, role: str | None, value: Any) -> KVTransferConfig | None:
        """The config of an instance with ``role`` from None, a KVTransferConfig, a dict or a
        JSON object string. Keys that do not apply to the role are refused, not ignored."""
        if isinstance(value, KVTransferConfig):
            if role is not None and value.role != role:
                raise ValueError(f"kv_transfer_config is for role {value.role!r}, the instance's is {role!r}")
            return value
        if role is None:
            if value is not None:
                raise ValueError("--kv-transfer-config needs --kv-role prefill|decode")
            return None
        value = {} if value is None else json_object("kv_transfer_config", value,
                                                     (f.name for f in fields(cls) if f.name != "role"))
        per_role = {"prefill": {"host", "port", "advertise_host", "timeout_s"}, "decode": {"transport", "timeout_s"}}
        allowed = per_role.get(role, set())
        for key in sorted(value):
            if key not in allowed:
                raise ValueError(f"kv_transfer_config: {key!r} does not apply to a {role} instance (it takes "
                                 f"{', '.join(sorted(allowed))})")
        return cls(role=role, **value)
