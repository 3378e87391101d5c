/*
 * An open-addressing map from a 64-bit key (never 0) to a pointer, with
 * linear probing, doubling growth and backward-shift deletion: the node
 * table and the taint set of bridge_meta.c.  Pure memory, no locks (the
 * caller holds its own); an allocation failure leaves the map unchanged and
 * is the caller's to handle (both callers treat the map as a cache).
 */
#include "bridge_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static size_t map_home(uint64_t key, size_t cap)
{
    return (size_t)((key * 0x9e3779b97f4a7c15ull) >> 20) & (cap - 1);
}

void *map_get(const struct u64map *m, uint64_t key)
{
    if (m->cap == 0 || key == 0)
        return NULL;
    for (size_t i = map_home(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key)
            return m->values[i];
        if (m->keys[i] == 0)
            return NULL;
    }
}

static void map_place(uint64_t *keys, void **values, size_t cap, uint64_t key, void *value)
{
    size_t i = map_home(key, cap);
    while (keys[i] != 0 && keys[i] != key)
        i = (i + 1) & (cap - 1);
    keys[i] = key;
    values[i] = value;
}

int map_put(struct u64map *m, uint64_t key, void *value)
{
    if (map_get(m, key) != NULL) {
        map_place(m->keys, m->values, m->cap, key, value);
        return 0;
    }
    if (2 * (m->len + 1) > m->cap) {
        size_t cap = m->cap ? 2 * m->cap : 1024;
        uint64_t *keys = zalloc_touched(cap, sizeof *keys);
        void **values = zalloc_touched(cap, sizeof *values);
        if (keys == NULL || values == NULL) {
            free(keys);
            free(values);
            return -ENOMEM;
        }
        for (size_t i = 0; i < m->cap; i++) {
            if (m->keys[i] != 0)
                map_place(keys, values, cap, m->keys[i], m->values[i]);
        }
        free(m->keys);
        free(m->values);
        m->keys = keys;
        m->values = values;
        m->cap = cap;
    }
    map_place(m->keys, m->values, m->cap, key, value);
    m->len++;
    return 0;
}

void map_del(struct u64map *m, uint64_t key)
{
    if (m->cap == 0 || key == 0)
        return;
    size_t mask = m->cap - 1, i = map_home(key, m->cap);
    while (m->keys[i] != key) {
        if (m->keys[i] == 0)
            return;
        i = (i + 1) & mask;
    }
    size_t hole = i;
    for (size_t j = (i + 1) & mask; m->keys[j] != 0; j = (j + 1) & mask) {
        size_t home = map_home(m->keys[j], m->cap);
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            m->keys[hole] = m->keys[j];
            m->values[hole] = m->values[j];
            hole = j;
        }
    }
    m->keys[hole] = 0;
    m->values[hole] = NULL;
    m->len--;
}

int bridge_test_meta_map(const uint64_t *ops, uint32_t n, uint64_t probe)
{
    /* ops: keys to add, or ~key (high bit set) to remove, in a scratch map */
    struct u64map m;
    memset(&m, 0, sizeof m);
    for (uint32_t k = 0; k < n; k++) {
        if (ops[k] >> 63)
            map_del(&m, ~ops[k]);
        else if (map_put(&m, ops[k], (void *)1) != 0)
            return -ENOMEM;
    }
    int found = map_get(&m, probe) != NULL;
    free(m.keys);
    free(m.values);
    return found;
}
