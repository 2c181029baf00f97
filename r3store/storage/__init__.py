"""Storage: the object stores (`store`), the formats r3store keeps in them (shards,
object keys, the store's identity) and the catalog that indexes them."""
