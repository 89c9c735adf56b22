/* The ops of kvexport's native library, registered together in domain ai.kvexport (qmatmul.c's RegisterCustomOps). */
#ifndef KVEXPORT_NATIVE_OPS_H
#define KVEXPORT_NATIVE_OPS_H

#include "onnxruntime_c_api.h"

/* Int8CacheAttention (attention.c); `api` is kept for its kernels */
const OrtCustomOp *kvx_attention_op(const OrtApi *api);

#endif
