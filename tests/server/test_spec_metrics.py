"""/metrics carries the engine's speculative-decoding counters under vLLM's names."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.engine.test_speculative import copying_request, make, prefill
from yaied.core.step import StepOutput
from yaied.server.metrics import ServerMetrics


def test_metrics_export_the_counters_as_vllm_names_them():
    scheduler, _ = make()
    request = copying_request()
    prefill(scheduler, request)
    scheduler.update(scheduler.schedule(), StepOutput([99], num_accepted_drafts=[2]))
    stats = {"num_pages": 8, "num_free_pages": 8, **scheduler.counters()}
    metrics = ServerMetrics("m", lambda: {"0": stats})
    text = metrics.render().decode()
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert values["yaied:spec_decode_num_drafts_total"] == 1
    assert values["yaied:spec_decode_num_draft_tokens_total"] == 3
    assert values["yaied:spec_decode_num_accepted_tokens_total"] == 2
