"""/metrics carries the standard process series (prometheus-client's ProcessCollector) in the
app's own registry, as a scraper of any Python service expects them: the daemon's resident
memory, CPU seconds, open files and start time."""

from __future__ import annotations

import os
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from yaied.server.metrics import ServerMetrics


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read from /proc")
def test_the_daemons_own_memory_and_cpu_are_scraped():
    metrics = ServerMetrics("smol", lambda: {})
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    # this process's, read at the scrape: within a few MB of what /proc said a moment before
    assert abs(samples["process_resident_memory_bytes"] - resident) < 64 * 1024**2
    assert samples["process_cpu_seconds_total"] > 0
    assert samples["process_open_fds"] >= 3
    assert samples["process_start_time_seconds"] > 0
