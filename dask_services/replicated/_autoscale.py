"""Autoscaling of a replicated service: a pure policy (load samples in, decisions out).

``options(autoscaling={"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 2,
"upscale_delay": "2s", "downscale_delay": "30s"})`` — the names Ray Serve uses.  The
scheduler part (``_scheduler.py``) samples each autoscaled deployment every
``dask_services.replicated.autoscaling-interval``: the calls running or queued on its
healthy replicas (``ongoing``, from the replicas' heartbeat figures) and how many replicas
it has (``replicas``, starting ones included).  :class:`AutoscalePolicy` turns the samples
into decisions:

* the *desired* count is ``ceil(ongoing / target_ongoing_requests)``, within
  ``[max(min_replicas, floor), max_replicas]`` (``floor``: the last ``svc.scale(n)``);
* when it stays above the current count for ``upscale_delay`` (the average ongoing calls
  per replica stay above the target), the policy decides to scale up to it; when it stays
  below for ``downscale_delay``, to scale down to it; a count outside the bounds is
  corrected at once;
* after a decision the delays start again, so each decision sees the effect of the last;
* with ``min_replicas: 0`` the service scales to zero replicas once no call was made
  for ``downscale_delay`` (``called``: the replicas' call counts grew since the last
  sample); a call made then waits (``ongoing`` counts the callers waiting for a replica)
  and, while no replica is healthy, the policy scales up to what the waiting calls need at
  once, without ``upscale_delay``.

Nothing here does I/O or reads a clock: ``observe`` takes the time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dask.utils import parse_timedelta

_NAMES = ("min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests",
          "upscale_delay", "downscale_delay")


@dataclass(frozen=True)
class AutoscalingConfig:
    """Validated ``options(autoscaling=...)``; delays in seconds."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 2.0
    upscale_delay: float = 30.0
    downscale_delay: float = 600.0
    initial_replicas: int | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> AutoscalingConfig:
        """From the user's mapping (durations may be strings such as ``"2s"``)."""
        if not isinstance(options, Mapping):
            raise TypeError(f"options(autoscaling=...) must be a dict, got {options!r}")
        unknown = set(options) - set(_NAMES)
        if unknown:
            raise TypeError(f"unknown autoscaling option(s) {sorted(unknown)}; the options "
                            f"are {list(_NAMES)}")
        values = dict(options)
        for name in ("upscale_delay", "downscale_delay"):
            if name in values:
                try:
                    values[name] = float(parse_timedelta(values[name], default="seconds"))
                except (TypeError, ValueError, KeyError) as e:
                    raise ValueError(f"autoscaling {name} must be a duration such as '2s', "
                                     f"got {values[name]!r}") from e
        config = cls(**values)
        config.check()
        return config

    def check(self) -> None:
        for name, least in (("min_replicas", 0), ("max_replicas", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"autoscaling {name} must be an integer >= {least}, got "
                                 f"{value!r}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscaling max_replicas ({self.max_replicas}) is below "
                             f"min_replicas ({self.min_replicas})")
        if self.initial_replicas is not None and not (
                isinstance(self.initial_replicas, int)
                and not isinstance(self.initial_replicas, bool)
                and self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError("autoscaling initial_replicas must be an integer between "
                             f"min_replicas and max_replicas, got {self.initial_replicas!r}")
        target = self.target_ongoing_requests
        if isinstance(target, bool) or not isinstance(target, (int, float)) or target <= 0:
            raise ValueError("autoscaling target_ongoing_requests must be a number > 0, got "
                             f"{target!r}")
        for name in ("upscale_delay", "downscale_delay"):
            if getattr(self, name) < 0:
                raise ValueError(f"autoscaling {name} must be >= 0")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def initial(self, replicas: int) -> int:
        """The replicas to deploy first: ``initial_replicas``, else ``replicas`` within
        the bounds."""
        if self.initial_replicas is not None:
            return self.initial_replicas
        return min(max(replicas, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class Decision:
    """Scale from ``current`` to ``target`` replicas, because ``reason``."""

    current: int
    target: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down"

    def __str__(self) -> str:
        return f"{self.current} -> {self.target}: {self.reason}"


@dataclass
class AutoscalePolicy:
    """The autoscaling state of one deployment: since when the load has asked for more
    (``above_since``) or fewer (``below_since``) replicas."""

    config: AutoscalingConfig
    above_since: float | None = None
    below_since: float | None = None

    def bounds(self, floor: int) -> tuple[int, int]:
        """Fewest and most replicas allowed with ``svc.scale(floor)`` in force."""
        low = max(self.config.min_replicas, floor)
        return low, max(self.config.max_replicas, low)

    def desired(self, ongoing: float, floor: int = 0) -> int:
        """Replicas for ``ongoing`` calls at the target, within the bounds."""
        low, high = self.bounds(floor)
        want = math.ceil(max(ongoing, 0) / self.config.target_ongoing_requests)
        return min(max(want, low), high)

    def observe(self, now: float, replicas: int, ongoing: float, floor: int = 0, *,
                called: bool = False, none_ready: bool = False) -> Decision | None:
        """One load sample at time ``now``: ``ongoing`` calls running or queued on
        ``replicas`` replicas (and callers waiting for one).  ``called``: calls were made
        since the last sample, though none may be under way at the instant it was taken
        (a service in steady use of short calls is not idle: it keeps one replica);
        ``none_ready``: no replica is healthy yet.  Returns a decision, or None to stay."""
        low, high = self.bounds(floor)
        if replicas < low or replicas > high:
            self.above_since = self.below_since = None
            target = low if replicas < low else high
            return Decision(replicas, target, f"{replicas} replicas outside the bounds "
                                              f"[{low}, {high}]")
        want = self.desired(ongoing, floor)
        if called and want == 0:  # in use, though nothing was under way: not idle
            want = 1
        average = ongoing / replicas if replicas else math.inf
        target = self.config.target_ongoing_requests
        if want > replicas and (replicas == 0 or none_ready) and ongoing > 0:
            # calls wait and no replica serves them (scaled to zero, or waking from it):
            # up now, to what they need, without upscale_delay
            self.above_since = self.below_since = None
            return Decision(replicas, want,
                            f"{ongoing:g} calls waiting with no healthy replica")
        if want > replicas:
            self.below_since = None
            if self.above_since is None:
                self.above_since = now
            if now - self.above_since >= self.config.upscale_delay:
                self.above_since = None
                return Decision(replicas, want, (
                    f"{average:.2f} ongoing calls per replica (target "
                    f"{target:g}) for {self.config.upscale_delay:g} s"))
        elif want < replicas:
            self.above_since = None
            if self.below_since is None:
                self.below_since = now
            if now - self.below_since >= self.config.downscale_delay:
                self.below_since = None
                return Decision(replicas, want, (
                    f"{average:.2f} ongoing calls per replica (target "
                    f"{target:g}) for {self.config.downscale_delay:g} s"))
        else:
            self.above_since = self.below_since = None
        return None
