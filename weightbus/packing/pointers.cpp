// The data pointers of a list of tensors in one call (weightbus.packing.native.data_ptrs), and
// what else is looked at in them per update (native.layouts, native.same_items).
//
// Why by hand: a pointer pass runs at every update over every tensor a source follows or a
// rollout exported (to see that none moved), and from Python it costs 130-165 ns a tensor
// (a bound-method call and an int box each): 15 ms for 100,000 tensors, 1.2 ms for a 30B
// MoE's 9,435. torch has no call that returns many tensors' pointers; here it is ~30 ns.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <exception>

// The address of obj's bytes: its data_ptr(), or, for a wrapper with no bytes of its own
// whose _local_tensor is a tensor (a DTensor), that tensor's. False with a Python error set.
static bool pointer_of(PyObject* obj, Py_ssize_t i, int64_t* out, int depth) {
  if (!THPVariable_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "data_ptrs: item %zd is a %s, not a tensor", i, Py_TYPE(obj)->tp_name);
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  void* p = nullptr;
  try {
    if (t.has_storage()) p = t.data_ptr();
  } catch (const std::exception&) {
    p = nullptr;  // (a storage that refuses access: a wrapper's; its local tensor below)
  }
  if (p == nullptr && depth == 0) {
    PyObject* local = PyObject_GetAttrString(obj, "_local_tensor");
    if (local == nullptr) {
      PyErr_Clear();  // (an empty tensor, or a wrapper of nothing: 0, as torch says)
    } else {
      const bool ok = pointer_of(local, i, out, 1);
      Py_DECREF(local);
      return ok;
    }
  }
  *out = reinterpret_cast<int64_t>(p);
  return true;
}

// What pointer_of reads of items[i] is three objects that point to each other (the Python
// object, its TensorImpl, its StorageImpl): for tensors scattered over the heap (a model's,
// allocated among everything else) each is a cache miss, one after the other. They are
// prefetched a few items ahead, each stage reading only what an earlier one fetched, so
// the misses of several items overlap (9,435 tensors scattered among other objects, caches
// evicted, on a 2-core CI host: 0.58-0.82 ms without, 0.41 ms with; 16 ahead is no better).
static constexpr Py_ssize_t kAhead = 8;

static inline c10::TensorImpl* impl_of(PyObject* obj) {
  return THPVariable_Check(obj) ? THPVariable_Unpack(obj).unsafeGetTensorImpl() : nullptr;
}

static inline void prefetch_lines(const void* p, int lines) {
  for (int k = 0; k < lines; k++) __builtin_prefetch(static_cast<const char*>(p) + 64 * k);
}

static inline void prefetch_ahead(PyObject** items, Py_ssize_t i, Py_ssize_t n) {
  if (i + 3 * kAhead < n) prefetch_lines(items[i + 3 * kAhead], 2);
  if (i + 2 * kAhead < n) {
    if (c10::TensorImpl* impl = impl_of(items[i + 2 * kAhead])) prefetch_lines(impl, 4);
  }
  if (i + kAhead < n) {
    if (c10::TensorImpl* impl = impl_of(items[i + kAhead])) {
      if (c10::StorageImpl* st = impl->unsafe_storage().unsafeGetStorageImpl()) prefetch_lines(st, 1);
    }
  }
}

// The pass data_ptrs and layouts share: args (a sequence of tensors, an output address),
// each item prefetched ahead and handed to write(item, i, out), which returns false with a
// Python error set (the pass then stops and raises it).
template <typename Write>
static PyObject* tensor_pass(PyObject* args, const char* what, Write write) {
  PyObject* seq;
  unsigned long long out;
  if (!PyArg_ParseTuple(args, "OK", &seq, &out)) return nullptr;
  PyObject* fast = PySequence_Fast(seq, what);
  if (fast == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  int64_t* dst = reinterpret_cast<int64_t*>(out);
  for (Py_ssize_t i = 0; i < n; i++) {
    prefetch_ahead(items, i, n);
    if (!write(items[i], i, dst)) {
      Py_DECREF(fast);
      return nullptr;
    }
  }
  Py_DECREF(fast);
  Py_RETURN_NONE;
}

// data_ptrs(tensors, out): writes item i's address (pointer_of) to ((int64_t*)out)[i];
// TypeError, naming the item, for one that is not a tensor.
static PyObject* data_ptrs(PyObject*, PyObject* args) {
  return tensor_pass(args, "data_ptrs: a sequence of tensors",
                     [](PyObject* obj, Py_ssize_t i, int64_t* dst) { return pointer_of(obj, i, dst + i, 0); });
}

// Item i's address (pointer_of) at out[2 i] and a hash of its sizes, strides, dtype and
// device at out[2 i + 1]. False with a Python error set.
static bool layout_of(PyObject* obj, Py_ssize_t i, int64_t* out) {
  if (!pointer_of(obj, i, out + 2 * i, 0)) return false;
  uint64_t h = 1469598103934665603ULL;  // (FNV-1a over the words below)
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    mix(static_cast<uint64_t>(t.dim()));
    for (int64_t s : t.sizes()) mix(static_cast<uint64_t>(s));
    for (int64_t s : t.strides()) mix(static_cast<uint64_t>(s));
    mix(static_cast<uint64_t>(t.scalar_type()));
    mix(static_cast<uint64_t>(t.device().type()));
    mix(static_cast<uint64_t>(t.device().index()) + 1);
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_RuntimeError, "layouts: item %zd: %s", i, e.what());
    return false;
  }
  out[2 * i + 1] = static_cast<int64_t>(h);
  return true;
}

// layouts(tensors, out): layout_of each item: what a caller keeps views of a tensor by (a
// tensor given other metadata at its address reads differently). From Python, those four
// attributes cost ~0.4 us a tensor, in four passes; here one pass.
static PyObject* layouts(PyObject*, PyObject* args) {
  return tensor_pass(args, "layouts: a sequence of tensors", layout_of);
}

// same_items(a, b): whether two sequences hold the very same objects, in order (a pass over
// two arrays of pointers; from Python, map(operator.is_, ...) costs ~25 ns an item).
static PyObject* same_items(PyObject*, PyObject* args) {
  PyObject *a, *b;
  if (!PyArg_ParseTuple(args, "OO", &a, &b)) return nullptr;
  PyObject* fa = PySequence_Fast(a, "same_items: a sequence");
  if (fa == nullptr) return nullptr;
  PyObject* fb = PySequence_Fast(b, "same_items: a sequence");
  if (fb == nullptr) {
    Py_DECREF(fa);
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fa);
  bool same = n == PySequence_Fast_GET_SIZE(fb);
  PyObject** ia = PySequence_Fast_ITEMS(fa);
  PyObject** ib = PySequence_Fast_ITEMS(fb);
  for (Py_ssize_t i = 0; same && i < n; i++) same = ia[i] == ib[i];
  Py_DECREF(fa);
  Py_DECREF(fb);
  return PyBool_FromLong(same);
}

static PyMethodDef methods[] = {
    {"data_ptrs", data_ptrs, METH_VARARGS, "data_ptrs(tensors, out_address)"},
    {"same_items", same_items, METH_VARARGS, "same_items(a, b)"},
    {"layouts", layouts, METH_VARARGS, "layouts(tensors, out_address)"},
    {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wb_pointers", nullptr, -1, methods};

PyMODINIT_FUNC PyInit__wb_pointers(void) { return PyModule_Create(&module); }
