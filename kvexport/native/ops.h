/* The ops of kvexport's native library, registered together in domain ai.kvexport (qmatmul.c's RegisterCustomOps),
 * and what their ONNX Runtime glue shares. */
#ifndef KVEXPORT_NATIVE_OPS_H
#define KVEXPORT_NATIVE_OPS_H

#include <string.h>

#include "onnxruntime_c_api.h"

#define RETURN_IF(status_expr)          \
  do {                                  \
    OrtStatus *st_ = (status_expr);     \
    if (st_ != NULL) return st_;        \
  } while (0)

/* An invalid-argument status with `msg`. */
static inline OrtStatus *kvx_fail(const OrtApi *api, const char *msg) {
  return api->CreateStatus(ORT_INVALID_ARGUMENT, msg);
}

/* A tensor's dimensions (at most 8), their count and (where `type` is given) its element type. */
static inline OrtStatus *kvx_dims(const OrtApi *api, const OrtValue *v, int64_t *dims, size_t *rank,
                                  ONNXTensorElementDataType *type) {
  OrtTensorTypeAndShapeInfo *info = NULL;
  RETURN_IF(api->GetTensorTypeAndShape(v, &info));
  OrtStatus *st = api->GetDimensionsCount(info, rank);
  if (st == NULL && *rank > 8) st = kvx_fail(api, "kvexport native op: tensor of rank above 8");
  if (st == NULL) st = api->GetDimensions(info, dims, *rank);
  if (st == NULL && type != NULL) st = api->GetTensorElementType(info, type);
  api->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

/* Int8CacheAttention (f32 = 0) or Fp32CacheAttention (f32 = 1), attention.c; `api` is kept for their kernels */
const OrtCustomOp *kvx_attention_op(const OrtApi *api, int f32);

static const char *ORT_API_CALL kvx_cpu_ep(const OrtCustomOp *op) {
  (void)op;
  return "CPUExecutionProvider";
}
static OrtMemType ORT_API_CALL kvx_default_mem(const OrtCustomOp *op, size_t i) {
  (void)op;
  (void)i;
  return OrtMemTypeDefault;
}
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL kvx_required(const OrtCustomOp *op, size_t i) {
  (void)op;
  (void)i;
  return INPUT_OUTPUT_REQUIRED;
}
static int ORT_API_CALL kvx_one(const OrtCustomOp *op) {
  (void)op;
  return 1;
}
static int ORT_API_CALL kvx_start_version(const OrtCustomOp *op) {
  (void)op;
  return 1;
}
static int ORT_API_CALL kvx_end_version(const OrtCustomOp *op) {
  (void)op;
  return 0x7fffffff;
}

/* `op` cleared and given what every op here shares: the CPU execution provider, inputs in CPU memory, all of
 * them required (an op with optional ones sets GetInputCharacteristic after), no variadic arguments, every
 * opset version of the domain. */
static inline void kvx_common(OrtCustomOp *op) {
  memset(op, 0, sizeof(*op));
  op->version = ORT_API_VERSION;
  op->GetExecutionProviderType = kvx_cpu_ep;
  op->GetInputMemoryType = kvx_default_mem;
  op->GetInputCharacteristic = kvx_required;
  op->GetOutputCharacteristic = kvx_required;
  op->GetVariadicInputMinArity = kvx_one;
  op->GetVariadicInputHomogeneity = kvx_one;
  op->GetVariadicOutputMinArity = kvx_one;
  op->GetVariadicOutputHomogeneity = kvx_one;
  op->GetStartVersion = kvx_start_version;
  op->GetEndVersion = kvx_end_version;
}

#endif
