"""What a stored value is and how it moves: its format (``codec``), its MAC under a namespace
secret (``value_auth``), the chained block hashes and key names it is stored under (``hashing``,
``keys``, ``ttl``), the one write path (``writes``), the one read path (``reads``), reads of a
value's tensors by ranges (``tensor_reads``), and ``drop_select``'s atomic get-and-delete
(``drop_select``)."""
