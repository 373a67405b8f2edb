"""How keyed() follows the batch through a forward: batching rules, replayed records, rows routed by value (MoE)."""
