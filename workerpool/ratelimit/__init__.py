"""Declared rate limits, separate from the concurrency bound.

A limiter is a named token bucket (``NAME = RATE/s`` with a burst). Jobs take one token per run
(``@job(..., rate_limit="NAME")``) or per outbound call (``ctx.acquire("NAME")``); an upstream
"too many requests" (``ctx.throttled`` or ``RateLimitedError``) lowers the rate for a while.
Limits are per process: to hold a global limit across R replicas, declare RATE / R on each.
"""

from workerpool.ratelimit.bucket import RateSpec, TokenBucket, Turn, parse_rate
from workerpool.ratelimit.limiters import LocalLimiters, RateLimiters

__all__ = ["LocalLimiters", "RateLimiters", "RateSpec", "TokenBucket", "Turn", "parse_rate"]
