/* Copies of many small host tensors in one call (weightbus.packing.native, buffers.CopyList):
 * the address and byte-count tables are made once per list; a call costs a memcpy per
 * entry and nothing else. */
#include <stdint.h>
#include <string.h>

void wb_copy_list(int64_t n, const int64_t *dst, const int64_t *src, const int64_t *nbytes) {
    for (int64_t i = 0; i < n; i++)
        if (nbytes[i] > 0)
            memcpy((void *)(intptr_t)dst[i], (const void *)(intptr_t)src[i], (size_t)nbytes[i]);
}
