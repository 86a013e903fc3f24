"""Steps: what happens to one record or document on its way through curation.

Reading a source file (``source_files``), formatting a record into documents
(``formatting``), the filters (``filters``, one module per recipe ``kind``,
registered in ``filter_registry``), the n-gram repetition statistics and their
numba kernel (``ngram_repetition``, ``ngram_jit``), dedup hashing and MinHash
(``dedup_hashing``, ``minhash_jit``), decontamination and tokenization. ``chain``
binds a source's recipe steps to these functions. Steps know nothing of
intermediate files, executors or shards.
"""
