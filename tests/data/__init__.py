"""keyinit.data: keyed order (permutation, KeyedSampler), keyed samples and collate, padding, golden vectors of spec 16."""
