"""The Lua script behind ``drop_select`` (exactly-once claims), and how to read its reply."""

from __future__ import annotations

from typing import Any

# Claims blocks for one caller, atomically: each present key is given the claim TTL (ARGV[4] ms)
# and then RENAMEd to a key private to this call (ARGV[3] is a fresh suffix); RENAME keeps the
# TTL, so a claim the caller never reads expires. The private key is ``keys.claim_key``: it
# carries the block's key as a hash tag, so on a Cluster it lives in the block's slot. The TTL
# is set first: if RENAME is refused (ACL) nothing is left behind without one. Values never
# pass through Lua: returning a multi-MiB string from a script costs ~4x a plain GET.
# ARGV[1]: max bytes, ARGV[2]: "all"
# (claim nothing unless every key is present; reply nil) or "any". Reply: a [status, length]
# pair per key; status 1 claimed, 0 missing, 2 over the size limit (left in place), 3 not a
# string. A key this call's suffix already claimed counts as claimed: the call may be sent
# again after a dropped connection and must not lose what it took the first time.
CLAIM_LUA = """
local maxlen = tonumber(ARGV[1])
local out = {}
local mine = {}
local missing = false
for i, k in ipairs(KEYS) do
  local n = redis.pcall('STRLEN', k .. ':claim:' .. ARGV[3] .. ':{' .. k .. '}')
  mine[i] = type(n) == 'number' and n > 0
  if not mine[i] then n = redis.pcall('STRLEN', k) end
  if type(n) == 'table' and n.err then
    if not string.find(tostring(n.err), 'WRONGTYPE', 1, true) then return n end
    out[2 * i - 1] = 3; out[2 * i] = 0
  elseif n == 0 then
    out[2 * i - 1] = 0; out[2 * i] = 0; missing = true
  elseif n > maxlen then
    out[2 * i - 1] = 2; out[2 * i] = n
  else
    out[2 * i - 1] = 1; out[2 * i] = n
  end
end
if missing and ARGV[2] == 'all' then return false end
for i, k in ipairs(KEYS) do
  if out[2 * i - 1] == 1 and not mine[i] then
    redis.call('PEXPIRE', k, ARGV[4])
    redis.call('RENAME', k, k .. ':claim:' .. ARGV[3] .. ':{' .. k .. '}')
  end
end
return out
"""
CLAIM_TTL_MS = 60_000


def claimed_values(statuses: list[int], lengths: list[Any], fetched: list[Any]) -> list[Any]:
    """Per key, what ``LookupBuffer._decode_all`` takes: a claimed key's fetched value, a
    length (oversize), -1 (wrong type) or None (missing)."""
    values = iter(fetched)
    raw: list[Any] = []
    for status, length in zip(statuses, lengths, strict=True):
        if status == 1:
            raw.append(next(values))
        elif status == 2:
            raw.append(int(length))
        elif status == 3:
            raw.append(-1)
        else:
            raw.append(None)
    return raw
