"""Steps: what happens to one record or document on its way through curation.

Reading a source file (``source_files``), formatting a record into documents
(``formatting``), the filters (``filters``, one module per recipe ``kind``), the
n-gram repetition statistics and their numba kernel, dedup hashing and MinHash
(``dedup_hashing``), decontamination and tokenization. ``chain`` binds a
source's recipe steps to these functions. Steps know nothing of files of
intermediates, executors or shards.
"""
