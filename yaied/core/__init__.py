"""What every layer shares: the step contract between engine and worker, the description of a
loaded model, requests and configuration. It imports no other part of yaied."""
