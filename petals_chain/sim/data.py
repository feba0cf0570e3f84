"""Workload and network data: the Azure LLM inference trace and RIPE Atlas RTTs, with synthetic fallbacks.

Both data sets live outside the project (``../shared/data/`` relative to the project root for
developers and CI; the environment variable ``PETALS_CHAIN_DATA_DIR`` names another directory, searched alone).
Every loader takes an explicit path; when the file is missing, a documented
synthetic substitute with matching statistics is generated instead (``source`` says which one was used).

Azure trace (code service, 2023-11-16): ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS.fffffff``, seven
fractional digits, which :mod:`datetime` cannot parse directly), ``ContextTokens``, ``GeneratedTokens``.
Synthetic fallback (:func:`synthetic_trace`): 8818 requests at exactly 2.57 req/s on average, bursty
arrivals (lognormal inter-arrival gaps whose distribution has coefficient of variation 13.15, as measured
on the real file; the tail is heavy, so a sample of 8818 gaps typically shows 5-11),
context tokens lognormal with mean 2048 / median 1469 clipped to [1, 7437], generated tokens lognormal
with mean 27.9 / median 13 clipped to [1, 1899].

RIPE Atlas (European anchors): one RTT per anchor = median of its positive ``latency_m1..m4`` samples;
the orchestrator sits at the lowest-latency anchor; ``J`` servers are sampled from the other anchors.
The RTT between two sites is modelled as the data's README prescribes,
``0.3*med_i + 0.3*med_j + 0.01 ms/km * great-circle distance``, and ``tau_c_j = RTT(orch, j) + 18 ms``
(the paper's serialization overhead, §4.1.1). Synthetic fallback (:func:`synthetic_anchors`): 320
anchors with lognormal medians (log-mean 3.353, log-std 0.272, i.e. median ~28.6 ms, matching the
real file) and coordinates uniform over a European box (lat 36-60 N, lon -10-30 E).
"""

from __future__ import annotations

import csv
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

TRACE_FILENAME = "azure_llm_inference_trace_code_2023-11-16.csv"
RTT_FILENAME = "ripe_atlas_eu_rtt.csv"
OVERHEAD_MS = 18.0  # per-job serialization overhead added to every RTT (§4.1.1)

# Statistics of the real files (documented fallbacks reproduce them).
TRACE_STATS = {
    "requests": 8818,
    "rate_per_s": 2.57,
    "context_mean": 2048.0,
    "context_median": 1469.0,
    "context_max": 7437,
    "generated_mean": 27.9,
    "generated_median": 13.0,
    "generated_max": 1899,
}
RTT_LOG_MEAN, RTT_LOG_STD, RTT_ANCHORS = 3.353, 0.272, 320
TRACE_GAP_CV = 13.15  # std of inter-arrival gaps / mean (the paper, Fig. 11a; the real file gives 13.15)


class DataError(ValueError):
    """A data file exists but cannot be parsed."""


def _candidate_dirs() -> list[Path]:
    """``$PETALS_CHAIN_DATA_DIR`` alone when set, else ``../shared/data`` relative to the cwd and to the project
    root (the package's parent)."""
    env = os.environ.get("PETALS_CHAIN_DATA_DIR")
    if env:
        # alone: pointed at a directory without a file (an empty one, to see the synthetic fallbacks), the shared
        # file was read anyway
        return [Path(env)]
    project_root = Path(__file__).resolve().parents[2]
    return [Path.cwd() / ".." / "shared" / "data", project_root / ".." / "shared" / "data"]


def default_data_path(filename: str) -> Path | None:
    """The first existing ``<filename>`` in :func:`_candidate_dirs`, or None."""
    for d in _candidate_dirs():
        p = (d / filename).resolve()
        if p.is_file():
            return p
    return None


# ----------------------------------------------------------------------------------------- trace


@dataclass
class Trace:
    """Request arrivals (seconds from the first request) with prompt and output lengths (tokens)."""

    arrivals: np.ndarray  # float64 seconds, non-decreasing, arrivals[0] == 0
    context_tokens: np.ndarray  # int64, l_in
    generated_tokens: np.ndarray  # int64, l_out
    source: str  # file path, or "synthetic"

    def __len__(self) -> int:
        return len(self.arrivals)

    def head(self, n: int) -> "Trace":
        """The first ``n`` requests (the paper replays the first 1000)."""
        return Trace(self.arrivals[:n].copy(), self.context_tokens[:n].copy(), self.generated_tokens[:n].copy(), self.source)

    @property
    def rate(self) -> float:
        """Mean arrival rate in requests per second."""
        span = float(self.arrivals[-1] - self.arrivals[0]) if len(self) > 1 else 0.0
        return (len(self) - 1) / span if span > 0 else math.inf

    def offset_s(self, start: int, k: int) -> float:
        """Trace seconds from row ``start`` to ``k`` rows later, wrapping around the end (one mean gap between
        laps)."""
        n = len(self)
        lap = float(self.arrivals[-1] - self.arrivals[0]) + (1.0 / self.rate if math.isfinite(self.rate) else 0.0)
        laps, end = divmod(start + k, n)
        return laps * lap + float(self.arrivals[end] - self.arrivals[start])

    def time_scale(self, rate: float, duration: float, start: int = 0) -> float:
        """Run seconds per trace second so that the rows from ``start`` on arrive at ``rate`` req/s on average over
        a run of ``duration`` seconds: the ``k = rate x duration`` rows after ``start`` (going round the trace as
        often as it takes) span ``k / rate`` seconds. Scaled by the whole trace's mean rate, a segment kept its own
        rate, tens of percent off the mean on the Azure traces: runs said to load chains at 0.8 loaded them at
        0.6-1.0."""
        if not (rate > 0 and duration > 0):
            raise ValueError(f"rate and duration must be positive, got {rate!r}, {duration!r}")
        k = max(1, round(rate * duration)) if len(self) > 1 else 0
        span = self.offset_s(start, k) if k > 0 else 0.0
        return k / rate / span if span > 0 else (self.rate / rate if math.isfinite(self.rate) else 1.0)


def parse_timestamp_ns(text: str) -> int:
    """Integer nanoseconds since the epoch (UTC) of ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (up to 9 fractional digits).

    Integers keep the trace's 100 ns ticks exact; a float of epoch seconds would round them to ~240 ns.
    """
    text = text.strip()
    if not text:
        raise DataError("empty timestamp")
    main, _, frac = text.partition(".")
    try:
        base = datetime.strptime(main, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    except ValueError as e:
        raise DataError(f"bad timestamp {text!r}: {e}") from None
    ns = int(base.timestamp()) * 1_000_000_000
    if frac:
        # %f accepts at most 6 digits, the trace has 7: parse the fraction ourselves
        if not frac.isdigit() or len(frac) > 9:
            raise DataError(f"bad fractional seconds in timestamp {text!r}")
        ns += int(frac.ljust(9, "0"))
    return ns


def parse_timestamp(text: str) -> float:
    """Seconds since the epoch (UTC) as a float (see :func:`parse_timestamp_ns` for exact values)."""
    return parse_timestamp_ns(text) / 1e9


@contextmanager
def _csv_errors(path: Path) -> Iterator[None]:
    """Report a file that is not UTF-8 text or not CSV (an over-long field, say) as a :class:`DataError`."""
    try:
        yield
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: not a CSV text file: {e}") from None


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Parse an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    path = Path(path)
    times: list[int] = []
    ctx: list[int] = []
    gen: list[int] = []
    with _csv_errors(path), path.open(newline="") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not need <= set(reader.fieldnames):
            raise DataError(f"{path}: expected columns {sorted(need)}, got {reader.fieldnames}")
        for lineno, row in enumerate(reader, start=2):
            try:
                t = parse_timestamp_ns(row["TIMESTAMP"])
                c = int(row["ContextTokens"])
                g = int(row["GeneratedTokens"])
            except (DataError, ValueError, TypeError) as e:
                raise DataError(f"{path}:{lineno}: {e}") from None
            if c < 0 or g < 0:
                raise DataError(f"{path}:{lineno}: negative token count")
            times.append(t)
            ctx.append(c)
            gen.append(g)
    if not times:
        raise DataError(f"{path}: no requests")
    ns = np.asarray(times, dtype=np.int64)
    order = np.argsort(ns, kind="stable")
    ns = ns[order]
    return Trace(
        arrivals=(ns - ns[0]).astype(np.float64) / 1e9,
        context_tokens=np.asarray(ctx, dtype=np.int64)[order],
        # a request generates at least one token (its first token comes out of the prefill)
        generated_tokens=np.maximum(np.asarray(gen, dtype=np.int64)[order], 1),
        source=str(path),
    )


def _lognormal_params(mean: float, median: float) -> tuple[float, float]:
    """(mu, sigma) of a lognormal with the given mean and median."""
    mu = math.log(median)
    sigma = math.sqrt(max(2.0 * (math.log(mean) - mu), 1e-12))
    return mu, sigma


def synthetic_trace(n: int = TRACE_STATS["requests"], *, rate: float = TRACE_STATS["rate_per_s"], seed: int = 0) -> Trace:
    """A bursty synthetic stand-in for the Azure code trace (statistics in the module docstring).

    Inter-arrival gaps are lognormal with coefficient of variation ``TRACE_GAP_CV`` (13.15, the
    paper's measured std ratio to an exponential), rescaled so the mean rate is exactly ``rate``.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    rng = np.random.default_rng(seed)
    sigma = math.sqrt(math.log1p(TRACE_GAP_CV**2))
    gaps = rng.lognormal(0.0, sigma, n - 1)
    if n > 1:
        gaps *= (1.0 / rate) / gaps.mean()
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
    mu_c, s_c = _lognormal_params(TRACE_STATS["context_mean"], TRACE_STATS["context_median"])
    mu_g, s_g = _lognormal_params(TRACE_STATS["generated_mean"], TRACE_STATS["generated_median"])
    ctx = np.clip(np.rint(rng.lognormal(mu_c, s_c, n)), 1, TRACE_STATS["context_max"]).astype(np.int64)
    gen = np.clip(np.rint(rng.lognormal(mu_g, s_g, n)), 1, TRACE_STATS["generated_max"]).astype(np.int64)
    return Trace(arrivals, ctx, gen, "synthetic")


def get_trace(path: str | os.PathLike[str] | None = None, *, seed: int = 0) -> Trace:
    """The trace at ``path``; with no path, the default shared file if present, else :func:`synthetic_trace`.

    An explicit path that does not exist is an error (a typo must not silently become synthetic data).
    """
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"trace file not found: {path}")
        return load_trace(path)
    found = default_data_path(TRACE_FILENAME)
    return load_trace(found) if found else synthetic_trace(seed=seed)


CONV_TRACE_FILENAME = "azure_llm_inference_trace_conv_2023-11-16.csv"
CONV_LENGTH_MEAN, CONV_LENGTH_P90 = 1366.0, 2820.0  # prompt + output tokens of the real conversation trace


def get_conversation_lengths(path: str | os.PathLike[str] | None = None, *, n: int = 20000,
                             seed: int = 0) -> tuple[np.ndarray, str]:
    """``(prompt + output tokens per request, source)`` of the Azure conversation trace at ``path`` (default:
    the shared file if present); else ``n`` synthetic lengths, lognormal with the real trace's mean and P90."""
    if path is not None or default_data_path(CONV_TRACE_FILENAME) is not None:
        trace = get_trace(path if path is not None else default_data_path(CONV_TRACE_FILENAME))
        return trace.context_tokens + trace.generated_tokens, trace.source
    # mean = exp(mu + s^2 / 2), P90 = exp(mu + z90 s): the smaller root of s^2 / 2 - z90 s + ln(P90 / mean) = 0
    z90 = 1.2815515655446004
    sigma = z90 - math.sqrt(z90 * z90 - 2.0 * math.log(CONV_LENGTH_P90 / CONV_LENGTH_MEAN))
    mu = math.log(CONV_LENGTH_MEAN) - sigma * sigma / 2.0
    lengths = np.maximum(np.rint(np.random.default_rng(seed).lognormal(mu, sigma, n)), 2).astype(np.int64)
    return lengths, "synthetic"


# ------------------------------------------------------------------------------------------ RTTs


@dataclass
class Anchors:
    """Per-anchor median RTT (ms) and coordinates (degrees)."""

    ids: list[str]
    median_ms: np.ndarray
    lat: np.ndarray
    lon: np.ndarray
    source: str

    def __len__(self) -> int:
        return len(self.ids)


def load_anchors(path: str | os.PathLike[str]) -> Anchors:
    """Parse the RIPE Atlas CSV: median of each anchor's positive latency samples, and its coordinates."""
    path = Path(path)
    samples: dict[str, list[float]] = {}
    coords: dict[str, tuple[float, float]] = {}
    with _csv_errors(path), path.open(newline="") as f:
        reader = csv.DictReader(f)
        lat_cols = [c for c in (reader.fieldnames or []) if c.startswith("latency_m")]
        if not lat_cols or "anchor_id" not in (reader.fieldnames or []):
            raise DataError(f"{path}: expected anchor_id and latency_m* columns, got {reader.fieldnames}")
        for row in reader:
            aid = row["anchor_id"].strip()
            if not aid:
                continue
            vals = samples.setdefault(aid, [])
            for c in lat_cols:
                try:
                    v = float(row[c])
                except (TypeError, ValueError):
                    continue
                if v > 0 and math.isfinite(v):
                    vals.append(v)
            try:
                lat, lon = float(row["latitude"]), float(row["longitude"])
            except (KeyError, TypeError, ValueError):
                continue
            # NaN or off-globe coordinates made every RTT NaN and failed planning far from the file
            if -90.0 <= lat <= 90.0 and -180.0 <= lon <= 180.0:
                coords.setdefault(aid, (lat, lon))
    ids = [a for a, v in samples.items() if v and a in coords]
    if len(ids) < 2:
        raise DataError(f"{path}: fewer than two anchors with positive latencies and coordinates on the globe "
                        "(latitude in [-90, 90], longitude in [-180, 180])")
    return Anchors(
        ids=ids,
        median_ms=np.array([float(np.median(samples[a])) for a in ids]),
        lat=np.array([coords[a][0] for a in ids]),
        lon=np.array([coords[a][1] for a in ids]),
        source=str(path),
    )


def synthetic_anchors(n: int = RTT_ANCHORS, *, seed: int = 0) -> Anchors:
    """Synthetic European anchors (statistics in the module docstring)."""
    rng = np.random.default_rng(seed)
    return Anchors(
        ids=[f"syn{i}" for i in range(n)],
        median_ms=rng.lognormal(RTT_LOG_MEAN, RTT_LOG_STD, n),
        lat=rng.uniform(36.0, 60.0, n),
        lon=rng.uniform(-10.0, 30.0, n),
        source="synthetic",
    )


_default_anchors: Anchors | None = None


def set_default_anchors(anchors: Anchors | None) -> None:
    """Make ``get_anchors()`` (no path) return ``anchors`` (the CLI's ``--rtt-file``); None restores the default."""
    global _default_anchors
    _default_anchors = anchors


def get_anchors(path: str | os.PathLike[str] | None = None, *, seed: int = 0) -> Anchors:
    """Anchors from ``path``; with no path, the ``--rtt-file`` override, the default shared file if present,
    else synthetic ones."""
    if path is None and _default_anchors is not None:
        return _default_anchors
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"RTT file not found: {path}")
        return load_anchors(path)
    found = default_data_path(RTT_FILENAME)
    return load_anchors(found) if found else synthetic_anchors(seed=seed)


def great_circle_km(lat1: float, lon1: float, lat2: np.ndarray, lon2: np.ndarray) -> np.ndarray:
    """Haversine distance in km."""
    p1, p2 = math.radians(lat1), np.radians(lat2)
    dphi = p2 - p1
    dlmb = np.radians(lon2) - math.radians(lon1)
    a = np.sin(dphi / 2) ** 2 + math.cos(p1) * np.cos(p2) * np.sin(dlmb / 2) ** 2
    return 2 * 6371.0 * np.arcsin(np.sqrt(np.clip(a, 0.0, 1.0)))


def sample_rtts_ms(anchors: Anchors, num_servers: int, rng: np.random.Generator) -> np.ndarray:
    """RTTs (ms) from the orchestrator (lowest-latency anchor) to ``num_servers`` randomly chosen other anchors.

    Sampled without replacement while anchors last, with replacement beyond that.
    """
    if num_servers < 0:
        raise ValueError("num_servers must be >= 0")
    orch = int(np.argmin(anchors.median_ms))
    others = np.array([i for i in range(len(anchors)) if i != orch])
    pick = rng.choice(others, size=num_servers, replace=num_servers > len(others))
    dist = great_circle_km(anchors.lat[orch], anchors.lon[orch], anchors.lat[pick], anchors.lon[pick])
    return 0.3 * anchors.median_ms[orch] + 0.3 * anchors.median_ms[pick] + 0.01 * dist


def sample_tau_c(anchors: Anchors, num_servers: int, rng: np.random.Generator, overhead_ms: float = OVERHEAD_MS) -> np.ndarray:
    """``tau_c_j`` in seconds: RTT(orchestrator, j) + ``overhead_ms`` (§4.1.1)."""
    return (sample_rtts_ms(anchors, num_servers, rng) + overhead_ms) / 1000.0


def interarrival_cv_ratio(arrivals: Sequence[float]) -> float:
    """std of inter-arrival times divided by an exponential's std with the same mean (the paper reports 13.15)."""
    gaps = np.diff(np.asarray(arrivals, dtype=np.float64))
    if len(gaps) < 2 or gaps.mean() <= 0:
        return math.nan
    return float(gaps.std() / gaps.mean())
