// autobyte._native: the scheduler's per-partition hot path in C++ (docs/architecture.md).
//
// One Engine per ScheduledOptimizer on the native path. It owns what happens once per partition:
//   * rank 0: the ready heap (earliest forward use first, older steps first), the credit window, the
//     partition plans, the collective-order frames to the followers (same wire format as order_channel.py), and
//     the all-reduce launch — on a C++ thread that never takes the GIL;
//   * followers: a C++ receiver thread reading rank 0's frames from the socket, and a C++ dispatch
//     thread that issues rank 0's log strictly in order as local gradients become ready;
//   * completion: a C++ callback on the work's future (gloo's worker thread, no GIL) returns the
//     credit and counts reduced elements per parameter; only a parameter whose whole slice is
//     reduced is handed to the Python update thread, in batches (one GIL hand-off per batch, not
//     per partition).
// Python keeps what needs Python: the gradient hooks (which call grad_ready), the optimizer updates,
// the configuration log and every user-facing guarantee. Invariant: no code path in this file takes
// the GIL except the Python-facing methods, which release it while they block; no lock is held
// while launching a collective or writing a socket (a future callback may run inline).

#include <ATen/ATen.h>
#include <pthread.h>
#include <sys/socket.h>
#include <time.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#ifndef AUTOBYTE_TORCH_VERSION
#define AUTOBYTE_TORCH_VERSION "unknown"
#endif

namespace py = pybind11;

namespace {

// Bumped whenever the Python <-> C++ interface changes: a stale build is refused, not misused.
constexpr int kInterfaceVersion = 4;

// Configurations cross the Python <-> C++ boundary as int64 with any negative value meaning None
// (no partitioning / unlimited credit / no tail window): autobyte.types.config_to_ints / NO_LIMIT_BYTES.
// Read only here.
inline bool is_unlimited(int64_t bytes) { return bytes < 0; }

// Collective-order frames: int64 little-endian, as order_channel.py's struct "<196q".
constexpr int64_t kMsgOrder = 1, kMsgConfig = 2, kMsgStop = 3;
constexpr int kMsgHeader = 4, kMsgMaxEntries = 64, kMsgLen = kMsgHeader + 3 * kMsgMaxEntries;

// Events handed to the Python update thread (wait_updates).
constexpr int kUpReduced = 1, kUpMarker = 2, kUpConfig = 3, kUpError = 4;

double now_s() {  // time.perf_counter() on Linux (CLOCK_MONOTONIC)
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}
int64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
int64_t wall_ns() {  // time.time_ns()
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
int64_t cpu_ns() {  // time.thread_time_ns()
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void name_thread(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

// ------------------------------------------------------------------ plans

struct PlanTemplate {
  std::vector<int64_t> starts, lengths;  // per partition, in elements
  std::vector<int32_t> first_part, last_part;  // per parameter: partitions its slice overlaps
  std::vector<int32_t> counts;  // per partition: parameters overlapping it
  std::vector<at::Tensor> views;  // per partition: the slice of the flat buffer (built once)
};

struct Plan {
  std::shared_ptr<PlanTemplate> tpl;
  std::vector<int32_t> remaining;
  int64_t left = 0;
  int64_t unready = 0;  // elements whose gradient of this step is not yet ready
  int64_t tail = 0;     // the tail window in elements (0: none): autobyte.types.Config.tail_bytes
  bool drain = false;   // a read waits for the whole step: autobyte/scheduler/dispatch.py, drain()
};

struct Ready {
  int64_t step, start, length;
  double t_ready;
  int32_t part;
  int32_t runs = 1;  // partitions merged into this slice (a drained step's contiguous run)
};
struct ReadyOrder {  // std::priority_queue pops the "largest": lowest step, then highest offset
  bool operator()(const Ready& a, const Ready& b) const {
    if (a.step != b.step) return a.step > b.step;
    return a.start < b.start;
  }
};

struct Issue {
  int64_t step, start, length;
  int32_t first, last;  // layout positions of the parameters the slice overlaps
};

struct DispatchEvent {
  enum Kind { Grad, Credit, Boundary, Drain, Stop } kind;
  int64_t step = 0, a = 0, b = 0, c = 0, d = 0;  // Grad: a=param; Credit: a=nbytes; Boundary: a,b,c,d=pb,cb,id,tb
};

struct StepStat {
  double t_first_issue = -1.0, queue_s = 0.0, t_last_done = 0.0;
  int64_t bytes = 0, parts = 0;
};

struct UpdateEvent {
  int kind;
  int64_t step = 0, a = 0, b = 0, c = 0, d = 0;
  std::vector<int64_t> params;
  std::string message;
};

// A weight reduced row-sparse (autobyte/scheduler/sparse_rows.py: the rule and why it is DDP's sum
// to the bit): one partition of its own in every plan; a mask all-reduce (MAX, a byte per row), then
// the union's rows packed, or the whole slice when more than half the rows are in the union.
// Changed only by the reduced masks, on the dispatch thread: the same on every rank.
struct SparseEntry {
  int64_t start = 0, rows = 0, cols = 0, length = 0;
  bool active = true;
  int dense_streak = 0;
};
constexpr int kDenseStepsOff = 4;  // sparse_rows.DENSE_STEPS_OFF

struct TraceRecord {  // one partition, for benchmarks/profile_partition.py (trace=True)
  int64_t step, start, length;
  double t_ready, t_issue0, t_issue1, t_done;
};

// ------------------------------------------------------------------ shared state

struct State : std::enable_shared_from_this<State> {
  // layout
  at::Tensor flat;
  int64_t n = 0, total = 0, elem = 4;
  std::vector<int64_t> sorted_offsets, by_offset, ext_len;
  c10::intrusive_ptr<c10d::Backend> backend;
  bool leader = true;
  std::vector<int> follower_fds;
  int leader_fd = -1;
  int rank = 0;
  bool trace = false;

  // dispatch side (m)
  std::mutex m;
  std::condition_variable cv;
  std::deque<DispatchEvent> events;
  std::deque<Issue> pending;  // followers: rank 0's log not yet issued
  std::vector<int64_t> produced;  // followers: last step whose gradient is in the buffer
  std::vector<double> produced_t;
  bool receiver_stopped = false;  // followers: rank 0's stop message arrived (or the channel died)
  bool closing = false;
  int64_t generation = 0;  // followers: bumped (under m) by every change the follower waits for

  // update side (um)
  std::mutex um;
  std::condition_variable ucv;
  std::deque<UpdateEvent> updates;
  std::vector<int64_t> reduced;  // per parameter: elements of its slice reduced in its current step
  std::map<int64_t, StepStat> step_stats;
  std::vector<TraceRecord> traces;
  std::string error;

  // threads
  std::mutex tm;
  std::condition_variable tcv;
  int threads_running = 0;
  std::vector<std::thread> threads;

  // statistics (read by Python at any time)
  std::atomic<int64_t> parts{0}, sched_ns{0}, backend_ns{0}, backend_wall_ns{0};
  std::atomic<int64_t> messages{0}, send_ns{0}, latency_ns{0}, latency_n{0};

  std::map<int64_t, std::shared_ptr<PlanTemplate>> templates;  // dispatch thread only
  std::map<int64_t, SparseEntry> sparse;  // row-sparse weights by slice start (dispatch thread only)
  std::atomic<int64_t> sparse_packed{0};
  std::unordered_map<uint64_t, at::Tensor> follower_views;  // dispatch thread only

  // ---------------------------------------------------------------- helpers

  std::pair<int32_t, int32_t> params_in(int64_t start, int64_t length) const {
    auto& offs = sorted_offsets;
    int32_t first = int32_t(std::upper_bound(offs.begin(), offs.end(), start) - offs.begin()) - 1;
    int32_t last =
        int32_t(std::upper_bound(offs.begin(), offs.end(), start + length - 1) - offs.begin()) - 1;
    return {first, last};
  }

  std::shared_ptr<PlanTemplate> plan_template(int64_t partition_bytes) {
    auto it = templates.find(partition_bytes);
    if (it != templates.end()) return it->second;
    auto t = std::make_shared<PlanTemplate>();
    t->first_part.assign(n, 0);
    t->last_part.assign(n, 0);
    if (is_unlimited(partition_bytes)) {  // one partition per parameter
      for (int64_t pos = 0; pos < n; ++pos) {
        int64_t i = by_offset[pos];
        t->starts.push_back(sorted_offsets[pos]);
        t->lengths.push_back(ext_len[i]);
        t->first_part[i] = t->last_part[i] = int32_t(pos);
        t->counts.push_back(1);
      }
    } else {  // partition_bytes slices, cut around the row-sparse weights (one partition each)
      int64_t size = std::max<int64_t>(1, partition_bytes / elem);
      auto cut = [&](int64_t a, int64_t end) {
        for (; a < end; a += size) {
          t->starts.push_back(a);
          t->lengths.push_back(std::min(size, end - a));
        }
      };
      int64_t a = 0;
      for (auto& [start, entry] : sparse) {
        cut(a, start);
        t->starts.push_back(start);
        t->lengths.push_back(entry.length);
        a = start + entry.length;
      }
      cut(a, total);
      t->counts.assign(t->starts.size(), 0);
      for (int64_t pos = 0; pos < n; ++pos) {
        int64_t i = by_offset[pos], off = sorted_offsets[pos];
        auto first = std::upper_bound(t->starts.begin(), t->starts.end(), off);
        auto last = std::upper_bound(t->starts.begin(), t->starts.end(), off + ext_len[i] - 1);
        int32_t k0 = int32_t(first - t->starts.begin()) - 1, k1 = int32_t(last - t->starts.begin()) - 1;
        t->first_part[i] = k0;
        t->last_part[i] = k1;
        for (int32_t k = k0; k <= k1; ++k) t->counts[k] += 1;
      }
    }
    for (size_t k = 0; k < t->starts.size(); ++k) t->views.push_back(flat.narrow(0, t->starts[k], t->lengths[k]));
    templates[partition_bytes] = t;
    return t;
  }

  Plan new_plan(int64_t partition_bytes, int64_t tail_bytes) {
    Plan p;
    p.tpl = plan_template(partition_bytes);
    p.remaining = p.tpl->counts;
    p.left = int64_t(p.tpl->starts.size());
    p.unready = total;
    p.tail = is_unlimited(tail_bytes) ? 0 : std::max<int64_t>(1, tail_bytes / elem);
    return p;
  }

  at::Tensor follower_view(int64_t start, int64_t length) {
    uint64_t key = (uint64_t(start) << 24) ^ uint64_t(length) ^ (uint64_t(length) << 44);
    auto it = follower_views.find(key);
    if (it != follower_views.end() && it->second.storage_offset() == flat.storage_offset() + start &&
        it->second.numel() == length)
      return it->second;
    if (follower_views.size() > 65536) follower_views.clear();
    at::Tensor view = flat.narrow(0, start, length);
    follower_views[key] = view;
    return view;
  }

  void fail(const std::string& message) {
    {
      std::lock_guard<std::mutex> g(um);
      if (error.empty()) error = message.empty() ? "unknown error in the native scheduler" : message;
      UpdateEvent ev;
      ev.kind = kUpError;
      ev.message = error;
      updates.push_back(std::move(ev));
    }
    ucv.notify_all();
  }

  // ---------------------------------------------------------------- decision channel

  void write_frame(int64_t* frame) {
    int64_t t0 = mono_ns();
    frame[2] = wall_ns();
    const char* data = reinterpret_cast<const char*>(frame);
    size_t size = sizeof(int64_t) * kMsgLen;
    for (int fd : follower_fds) {
      size_t sent = 0;
      while (sent < size) {
        ssize_t k = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL);
        if (k < 0) {
          if (errno == EINTR) continue;
          throw std::runtime_error(std::string("decision channel: send failed: ") + std::strerror(errno));
        }
        sent += size_t(k);
      }
    }
    messages += 1;
    send_ns += mono_ns() - t0;
  }

  void send_config(int64_t step, int64_t pb, int64_t cb, int64_t decision_id, int64_t tb) {
    int64_t frame[kMsgLen] = {0};
    frame[0] = kMsgConfig;
    frame[1] = step;
    frame[3] = decision_id;
    frame[4] = pb;
    frame[5] = cb;
    frame[6] = tb;
    write_frame(frame);
  }

  void send_order(const std::vector<Ready>& batch) {
    for (size_t b = 0; b < batch.size(); b += kMsgMaxEntries) {
      int64_t frame[kMsgLen] = {0};
      size_t count = std::min<size_t>(kMsgMaxEntries, batch.size() - b);
      frame[0] = kMsgOrder;
      frame[1] = int64_t(count);
      for (size_t k = 0; k < count; ++k) {
        frame[kMsgHeader + 3 * k] = batch[b + k].step;
        frame[kMsgHeader + 3 * k + 1] = batch[b + k].start;
        frame[kMsgHeader + 3 * k + 2] = batch[b + k].length;
      }
      write_frame(frame);
    }
  }

  void send_stop() {
    int64_t frame[kMsgLen] = {0};
    frame[0] = kMsgStop;
    write_frame(frame);
  }

  // ---------------------------------------------------------------- issue and completion

  // A row-sparse weight's collective (SparseEntry): the mask all-reduce, waited for here, then the
  // packed rows' all-reduce (returned, with what to run on completion; `nbytes`: the bytes sent), or
  // none when the whole slice is to be reduced (`nbytes` then says what the mask cost).
  c10::intrusive_ptr<c10d::Work> issue_sparse(SparseEntry& e, std::function<void()>& unpack, int64_t& nbytes) {
    at::Tensor view = flat.narrow(0, e.start, e.rows * e.cols).view({e.rows, e.cols});
    // the widest integer type a row's bytes and the table's offset divide into (sparse_rows._bits_dtype)
    int64_t align = (e.cols * elem) | (e.start * elem);
    at::ScalarType bits = align % 8 == 0 ? at::kLong : align % 4 == 0 ? at::kInt
                        : align % 2 == 0 ? at::kShort : at::kByte;
    auto [lo, hi] = at::aminmax(view.view(bits), 1);
    at::Tensor mask = lo.ne(0).logical_or_(hi.ne(0)).to(at::kByte);  // all-zero bits: min = max = 0
    {
      std::vector<at::Tensor> tensors{mask};
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::MAX;
      backend->allreduce(tensors, opts)->wait();
    }
    nbytes = e.rows;
    at::Tensor idx = mask.nonzero().squeeze(1);
    int64_t k = idx.numel();
    if (2 * k > e.rows) {
      if (++e.dense_streak >= kDenseStepsOff) e.active = false;
      return {};
    }
    e.dense_streak = 0;
    sparse_packed += 1;
    at::Tensor packed = at::empty({k * e.cols + 1}, flat.options());
    at::Tensor rows_out = packed.narrow(0, 0, k * e.cols).view({k, e.cols});
    at::index_select_out(rows_out, view, 0, idx);
    at::Tensor flag = flat.narrow(0, e.start + e.rows * e.cols, 1);
    packed.narrow(0, k * e.cols, 1).copy_(flag);
    std::vector<at::Tensor> tensors{packed};
    c10d::AllreduceOptions opts;
    auto work = backend->allreduce(tensors, opts);
    int64_t cols = e.cols;
    unpack = [view, idx, packed, flag, k, cols]() mutable {
      view.index_copy_(0, idx, packed.narrow(0, 0, k * cols).view({k, cols}));
      flag.copy_(packed.narrow(0, k * cols, 1));
    };
    nbytes += (k * e.cols + 1) * elem;
    return work;
  }

  // Launch one all-reduce; returns its CPU ns (the backend's part of the dispatch thread's time).
  int64_t issue(int64_t step, int64_t start, int64_t length, double t_ready, const at::Tensor& view) {
    c10d::AllreduceOptions opts;
    int64_t c0 = cpu_ns(), w0 = mono_ns();
    double t_issue0 = trace ? now_s() : 0.0;
    c10::intrusive_ptr<c10d::Work> work;
    std::function<void()> unpack;
    int64_t nbytes = length * elem;
    if (!sparse.empty()) {
      auto it = sparse.find(start);
      if (it != sparse.end() && it->second.active && it->second.length == length) {
        int64_t sent = 0;
        work = issue_sparse(it->second, unpack, sent);
        nbytes = work ? sent : nbytes + sent;
      }
    }
    if (!work) {
      std::vector<at::Tensor> tensors{view};
      work = backend->allreduce(tensors, opts);
    }
    int64_t w1 = mono_ns(), c1 = cpu_ns();
    backend_wall_ns += w1 - w0;
    double now = now_s();
    int64_t trace_index = -1;
    {
      std::lock_guard<std::mutex> g(um);
      StepStat& st = step_stats[step];
      if (st.t_first_issue < 0) st.t_first_issue = now;
      st.bytes += nbytes;
      st.parts += 1;
      st.queue_s += std::max(0.0, now - t_ready);
      if (trace) {
        trace_index = int64_t(traces.size());
        traces.push_back({step, start, length, t_ready, t_issue0, now, 0.0});
      }
    }
    parts += 1;
    std::weak_ptr<State> weak = weak_from_this();
    work->getFuture()->addCallback([weak, step, start, length, trace_index, unpack](c10::ivalue::Future& fut) {
      auto self = weak.lock();
      if (!self) return;
      if (unpack && !fut.hasError()) {
        try {
          unpack();  // the packed rows back into the flat buffer, before the parameter is ready
        } catch (const std::exception& error) {
          self->fail(std::string("row-sparse unpack failed: ") + error.what());
          return;
        }
      }
      self->on_reduced(fut, step, start, length, trace_index);
    });
    return c1 - c0;
  }

  // On the backend's completion thread: keep it short, never touch Python.
  void on_reduced(c10::ivalue::Future& fut, int64_t step, int64_t start, int64_t length, int64_t trace_index) {
    if (fut.hasError()) {
      fail(fut.tryRetrieveErrorMessage());
      return;
    }
    double t_done = now_s();
    if (leader) {
      {
        std::lock_guard<std::mutex> g(m);
        DispatchEvent ev{DispatchEvent::Credit};
        ev.a = length * elem;
        events.push_back(ev);
      }
      cv.notify_one();
    }
    bool wake = false;
    {
      std::lock_guard<std::mutex> g(um);
      int64_t end = start + length;
      auto& offs = sorted_offsets;
      int64_t pos = int64_t(std::upper_bound(offs.begin(), offs.end(), start) - offs.begin()) - 1;
      std::vector<int64_t> done;
      for (; pos < n && offs[pos] < end; ++pos) {
        int64_t i = by_offset[pos];
        int64_t overlap = std::min(end, offs[pos] + ext_len[i]) - std::max(start, offs[pos]);
        reduced[i] += overlap;
        if (reduced[i] == ext_len[i]) {
          reduced[i] = 0;
          done.push_back(i);
        }
      }
      StepStat& st = step_stats[step];
      if (t_done > st.t_last_done) st.t_last_done = t_done;
      if (trace_index >= 0 && trace_index < int64_t(traces.size())) traces[trace_index].t_done = t_done;
      if (!done.empty()) {
        // Merge into the last queued batch of the same step when the update thread has not taken it.
        if (!updates.empty() && updates.back().kind == kUpReduced && updates.back().step == step) {
          auto& ps = updates.back().params;
          ps.insert(ps.end(), done.begin(), done.end());
        } else {
          UpdateEvent ev;
          ev.kind = kUpReduced;
          ev.step = step;
          ev.params = std::move(done);
          updates.push_back(std::move(ev));
        }
        wake = true;
      }
    }
    if (wake) ucv.notify_one();
  }

  // ---------------------------------------------------------------- threads

  void thread_done() {
    {
      std::lock_guard<std::mutex> g(tm);
      threads_running -= 1;
    }
    tcv.notify_all();
  }

  void leader_loop(int64_t start_step, int64_t pb, int64_t cb, int64_t decision_id, int64_t tb) {
    bool followers = !follower_fds.empty();
    std::map<int64_t, Plan> plans;
    plans[start_step] = new_plan(pb, tb);
    int64_t credit = cb;  // is_unlimited(credit): no credit window
    bool in_tail = false;  // the newest step's backward is in its tail window: one collective at a time
    if (followers) send_config(start_step, pb, cb, decision_id, tb);
    std::vector<Ready> heap;
    ReadyOrder order;
    int64_t inflight = 0;
    std::deque<DispatchEvent> local;
    std::vector<Ready> batch;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return !events.empty(); });
        local.swap(events);
      }
      int64_t t0 = cpu_ns(), backend = 0;
      bool stop = false;
      for (auto& ev : local) {
        switch (ev.kind) {
          case DispatchEvent::Grad: {
            auto it = plans.find(ev.step);
            if (it == plans.end())
              throw std::runtime_error("a gradient of step " + std::to_string(ev.step) + " arrived before its plan");
            Plan& plan = it->second;
            const PlanTemplate& t = *plan.tpl;
            plan.unready -= ext_len[ev.a];
            in_tail = plan.unready > 0 && plan.unready <= plan.tail;
            double now = now_s();
            for (int32_t k = t.first_part[ev.a]; k <= t.last_part[ev.a]; ++k) {
              if (--plan.remaining[k] == 0) {
                heap.push_back({ev.step, t.starts[k], t.lengths[k], now, k});
                std::push_heap(heap.begin(), heap.end(), order);
              }
            }
            break;
          }
          case DispatchEvent::Credit:
            inflight -= ev.a;
            break;
          case DispatchEvent::Drain: {
            auto it = plans.find(ev.step);
            if (it != plans.end()) it->second.drain = true;
            break;
          }
          case DispatchEvent::Boundary: {
            plans[ev.step] = new_plan(ev.a, ev.d);
            if ((ev.a != pb || ev.b != cb || ev.c != decision_id || ev.d != tb) && followers) {
              int64_t c0 = cpu_ns();
              send_config(ev.step, ev.a, ev.b, ev.c, ev.d);
              backend += cpu_ns() - c0;
            }
            pb = ev.a;
            cb = ev.b;
            decision_id = ev.c;
            tb = ev.d;
            credit = cb;
            break;
          }
          case DispatchEvent::Stop:
            stop = true;
            break;
        }
        if (stop) break;
      }
      local.clear();
      if (stop) {
        if (followers) send_stop();
        return;
      }
      int64_t window = in_tail ? 1 : credit;  // in the tail: only while nothing is in flight
      // A step a read waits for in full: each contiguous run of its ready partitions is one
      // collective (never a row-sparse weight's slice), and once all of its gradients are
      // produced what is left of it goes out at once.
      auto draining = [&](const Ready& r) {
        const Plan& plan = plans[r.step];
        return plan.drain && plan.unready == 0;
      };
      auto open = [&] {
        return !heap.empty() && (is_unlimited(window) || inflight < window || draining(heap.front()));
      };
      if (open()) {
        batch.clear();
        while (open()) {
          std::pop_heap(heap.begin(), heap.end(), order);
          Ready r = heap.back();
          heap.pop_back();
          r.runs = 1;
          if (plans[r.step].drain && !sparse.count(r.start)) {
            while (!heap.empty() && heap.front().step == r.step &&
                   heap.front().start + heap.front().length == r.start && !sparse.count(heap.front().start)) {
              std::pop_heap(heap.begin(), heap.end(), order);
              const Ready& below = heap.back();
              r.start = below.start;
              r.length += below.length;
              r.t_ready = std::min(r.t_ready, below.t_ready);
              r.runs += 1;
              heap.pop_back();
            }
          }
          batch.push_back(r);
          inflight += r.length * elem;
        }
        if (followers) {
          int64_t c0 = cpu_ns();
          send_order(batch);
          backend += cpu_ns() - c0;
        }
        for (auto& r : batch) {
          Plan& plan = plans[r.step];
          backend += issue(r.step, r.start, r.length, r.t_ready,
                           r.runs == 1 ? plan.tpl->views[r.part] : flat.narrow(0, r.start, r.length));
          plan.left -= r.runs;
          if (plan.left == 0) plans.erase(r.step);
        }
      }
      sched_ns += cpu_ns() - t0 - backend;
      backend_ns += backend;
    }
  }

  void receiver_loop() {
    std::vector<int64_t> frame(kMsgLen);
    char* data = reinterpret_cast<char*>(frame.data());
    size_t size = sizeof(int64_t) * kMsgLen;
    while (true) {
      size_t got = 0;
      while (got < size) {
        ssize_t k = ::recv(leader_fd, data + got, size - got, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
          bool quiet;
          {
            std::lock_guard<std::mutex> g(m);
            quiet = closing;
            receiver_stopped = true;
            generation += 1;
          }
          cv.notify_all();
          if (!quiet)
            fail("rank 0 closed the decision channel without a stop message (did it fail?)");
          return;
        }
        got += size_t(k);
      }
      latency_ns += std::max<int64_t>(0, wall_ns() - frame[2]);
      latency_n += 1;
      int64_t kind = frame[0];
      if (kind == kMsgOrder) {
        int64_t count = frame[1];
        if (count < 0 || count > kMsgMaxEntries) {
          fail("malformed decision frame");
          return;
        }
        std::vector<Issue> entries;
        entries.reserve(size_t(count));
        for (int64_t k = 0; k < count; ++k) {
          int64_t s = frame[kMsgHeader + 3 * k], a = frame[kMsgHeader + 3 * k + 1],
                  len = frame[kMsgHeader + 3 * k + 2];
          if (a < 0 || len <= 0 || a + len > total) {
            fail("rank 0 sent a slice outside the gradient buffer: different models on the ranks?");
            return;
          }
          auto fl = params_in(a, len);
          entries.push_back({s, a, len, fl.first, fl.second});
        }
        {
          std::lock_guard<std::mutex> g(m);
          pending.insert(pending.end(), entries.begin(), entries.end());
          generation += 1;
        }
        cv.notify_one();
      } else if (kind == kMsgConfig) {
        {
          std::lock_guard<std::mutex> g(um);
          UpdateEvent ev;
          ev.kind = kUpConfig;
          ev.step = frame[1];
          ev.a = frame[4];
          ev.b = frame[5];
          ev.c = frame[3];
          ev.d = frame[6];
          updates.push_back(std::move(ev));
        }
        ucv.notify_one();
      } else if (kind == kMsgStop) {
        {
          std::lock_guard<std::mutex> g(m);
          receiver_stopped = true;
          generation += 1;
        }
        cv.notify_all();
        return;
      } else {
        fail("unknown decision message kind " + std::to_string(kind));
        return;
      }
    }
  }

  void follower_loop() {
    int32_t cursor = -1;  // first position of the head entry not yet known to be ready
    int64_t seen = -1;
    std::vector<std::pair<Issue, double>> ready;
    while (true) {
      bool stopping;
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return generation != seen; });  // decisions, gradients, stop
        seen = generation;
        stopping = receiver_stopped;
        // The head entries whose parameters all have their gradient of that step.
        while (!pending.empty()) {
          const Issue& e = pending.front();
          int32_t pos = std::max(e.first, cursor);
          while (pos <= e.last && produced[by_offset[pos]] >= e.step) ++pos;
          if (pos <= e.last) {
            cursor = pos;
            break;
          }
          cursor = -1;
          double t_ready = 0.0;
          for (int32_t q = e.first; q <= e.last; ++q) t_ready = std::max(t_ready, produced_t[by_offset[q]]);
          ready.emplace_back(e, t_ready);
          pending.pop_front();
        }
      }
      int64_t t0 = cpu_ns(), backend = 0;
      for (auto& [e, t_ready] : ready) backend += issue(e.step, e.start, e.length, t_ready, follower_view(e.start, e.length));
      ready.clear();
      sched_ns += cpu_ns() - t0 - backend;
      backend_ns += backend;
      if (stopping) return;
    }
  }

  template <typename F>
  void spawn(const std::string& name, F body) {
    {
      std::lock_guard<std::mutex> g(tm);
      threads_running += 1;
    }
    auto self = shared_from_this();
    threads.emplace_back([self, name, body]() {
      name_thread(name);
      try {
        body(*self);
      } catch (const std::exception& e) {
        self->fail(e.what());
      } catch (...) {
        self->fail("unknown error in the native scheduler thread " + name);
      }
      self->thread_done();
    });
  }
};

// ------------------------------------------------------------------ the Python-facing engine

class Engine {
 public:
  Engine(at::Tensor flat, std::vector<int64_t> sorted_offsets, std::vector<int64_t> by_offset,
         std::vector<int64_t> ext_len, const c10::intrusive_ptr<c10d::ProcessGroup>& group, bool leader,
         std::vector<int> follower_fds, int leader_fd, int rank, bool trace,
         std::vector<int64_t> sparse_starts, std::vector<int64_t> sparse_rows, std::vector<int64_t> sparse_cols)
      : s_(std::make_shared<State>()) {
    TORCH_CHECK(flat.device().is_cpu(), "the native scheduler path runs on CPU tensors only");
    TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "the flat buffer must be a contiguous vector");
    State& s = *s_;
    s.flat = flat;
    s.n = int64_t(by_offset.size());
    s.total = flat.numel();
    s.elem = int64_t(flat.element_size());
    s.sorted_offsets = std::move(sorted_offsets);
    s.by_offset = std::move(by_offset);
    s.ext_len = std::move(ext_len);
    TORCH_CHECK(int64_t(s.sorted_offsets.size()) == s.n && int64_t(s.ext_len.size()) == s.n,
                "inconsistent layout arrays");
    s.backend = group->getBackend(c10::DeviceType::CPU);
    s.leader = leader;
    s.follower_fds = std::move(follower_fds);
    s.leader_fd = leader_fd;
    s.rank = rank;
    s.trace = trace;
    s.produced.assign(s.n, -1);
    s.produced_t.assign(s.n, 0.0);
    s.reduced.assign(s.n, 0);
    TORCH_CHECK(sparse_rows.size() == sparse_starts.size() && sparse_cols.size() == sparse_starts.size(),
                "inconsistent row-sparse arrays");
    for (size_t k = 0; k < sparse_starts.size(); ++k) {
      SparseEntry e;
      e.start = sparse_starts[k];
      e.rows = sparse_rows[k];
      e.cols = sparse_cols[k];
      e.length = e.rows * e.cols + 1;
      TORCH_CHECK(e.rows > 0 && e.cols > 0 && e.start >= 0 && e.start + e.length <= s.total,
                  "a row-sparse weight outside the flat buffer");
      s.sparse[e.start] = e;
    }
  }

  ~Engine() {
    // Threads that are still running (a stuck peer) keep the state alive through their own
    // reference; they are detached so that the interpreter can exit.
    for (auto& t : s_->threads)
      if (t.joinable()) t.detach();
    for (int fd : s_->follower_fds) ::close(fd);
    s_->follower_fds.clear();
  }

  void start_leader(int64_t start_step, int64_t pb, int64_t cb, int64_t tb, int64_t decision_id) {
    TORCH_CHECK(s_->leader, "start_leader on a follower");
    s_->spawn("ab-r" + std::to_string(s_->rank) + "-leader",
              [=](State& s) { s.leader_loop(start_step, pb, cb, decision_id, tb); });
  }

  void start_follower() {
    TORCH_CHECK(!s_->leader && s_->leader_fd >= 0, "start_follower needs the socket from rank 0");
    s_->spawn("ab-r" + std::to_string(s_->rank) + "-follow", [](State& s) { s.follower_loop(); });
    s_->spawn("ab-r" + std::to_string(s_->rank) + "-recv", [](State& s) { s.receiver_loop(); });
  }

  // Between synchronized steps on every rank (nothing in flight): row-sparse reduction on or off for
  // every row-sparse weight (benchmarks pair the two in one run; ScheduledOptimizer._set_sparse_rows).
  void set_sparse_active(bool on) {
    std::lock_guard<std::mutex> g(s_->m);  // the dispatch thread reads the entries after taking m
    for (auto& [start, entry] : s_->sparse) {
      entry.active = on;
      entry.dense_streak = 0;
    }
  }

  // Training thread (gradient hook): parameter i's gradient of `step` is in the buffer.
  void grad_ready(int64_t i, int64_t step) {
    State& s = *s_;
    {
      std::lock_guard<std::mutex> g(s.m);
      if (s.leader) {
        DispatchEvent ev{DispatchEvent::Grad};
        ev.step = step;
        ev.a = i;
        s.events.push_back(ev);
      } else {
        s.produced[i] = step;
        s.produced_t[i] = now_s();
        s.generation += 1;
      }
    }
    s.cv.notify_one();
  }

  // Rank 0's step(): the plan of `step` uses (partition_bytes, credit_bytes, tail_bytes) (-1 = none).
  void step_boundary(int64_t step, int64_t pb, int64_t cb, int64_t tb, int64_t decision_id) {
    {
      std::lock_guard<std::mutex> g(s_->m);
      DispatchEvent ev{DispatchEvent::Boundary};
      ev.step = step;
      ev.a = pb;
      ev.b = cb;
      ev.c = decision_id;
      ev.d = tb;
      s_->events.push_back(ev);
    }
    s_->cv.notify_one();
  }

  // Rank 0: a read waits for every gradient of `step` (autobyte/scheduler/dispatch.py, drain()).
  void drain(int64_t step) {
    {
      std::lock_guard<std::mutex> g(s_->m);
      DispatchEvent ev{DispatchEvent::Drain};
      ev.step = step;
      s_->events.push_back(ev);
    }
    s_->cv.notify_one();
  }

  // A Python object was queued for the update thread: it takes it when it reaches this marker.
  void post_marker() {
    {
      std::lock_guard<std::mutex> g(s_->um);
      UpdateEvent ev;
      ev.kind = kUpMarker;
      s_->updates.push_back(std::move(ev));
    }
    s_->ucv.notify_one();
  }

  // Update thread: wait (GIL released) for reduced parameters, markers, configs or an error.
  py::list wait_updates() {
    std::deque<UpdateEvent> got;
    {
      py::gil_scoped_release no_gil;
      std::unique_lock<std::mutex> lock(s_->um);
      s_->ucv.wait(lock, [&] { return !s_->updates.empty(); });
      got.swap(s_->updates);
    }
    py::list out;
    for (auto& ev : got) {
      switch (ev.kind) {
        case kUpReduced:
          out.append(py::make_tuple(ev.kind, ev.step, py::cast(ev.params)));
          break;
        case kUpConfig:
          out.append(py::make_tuple(ev.kind, ev.step, ev.a, ev.b, ev.d, ev.c));
          break;
        case kUpError:
          out.append(py::make_tuple(ev.kind, ev.message));
          break;
        default:
          out.append(py::make_tuple(ev.kind));
      }
    }
    return out;
  }

  // (t_first_issue or None, bytes, partitions, queueing seconds, t_last_done) of a finished step.
  py::tuple take_step_stats(int64_t step) {
    StepStat st;
    {
      std::lock_guard<std::mutex> g(s_->um);
      auto it = s_->step_stats.find(step);
      if (it != s_->step_stats.end()) {
        st = it->second;
        s_->step_stats.erase(it);
      }
    }
    py::object first = st.t_first_issue < 0 ? py::object(py::none()) : py::object(py::float_(st.t_first_issue));
    return py::make_tuple(first, st.bytes, st.parts, st.queue_s, st.t_last_done);
  }

  // Stop the dispatch threads. Rank 0 sends its stop message; a follower waits up to timeout_s for
  // rank 0's, then closes its socket. Returns False if a thread had to be abandoned.
  bool stop(double timeout_s) {
    State& s = *s_;
    {
      std::lock_guard<std::mutex> g(s.m);
      s.closing = true;
      if (s.leader) {
        DispatchEvent ev{DispatchEvent::Stop};
        s.events.push_back(ev);
      }
    }
    s.cv.notify_all();
    bool clean;
    {
      py::gil_scoped_release no_gil;
      std::unique_lock<std::mutex> lock(s.tm);
      auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
      clean = s.tcv.wait_until(lock, deadline, [&] { return s.threads_running == 0; });
      if (!clean && s.leader_fd >= 0) {
        ::shutdown(s.leader_fd, SHUT_RDWR);  // wakes the receiver; the follower ends with it
        lock.unlock();
        {
          std::lock_guard<std::mutex> g(s.m);
          s.receiver_stopped = true;
          s.generation += 1;
        }
        s.cv.notify_all();
        lock.lock();
        s.tcv.wait_until(lock, std::chrono::steady_clock::now() + std::chrono::seconds(5),
                         [&] { return s.threads_running == 0; });
      }
    }
    bool detached = false;
    for (auto& t : s.threads) {
      if (!t.joinable()) continue;
      bool running;
      {
        std::lock_guard<std::mutex> g(s.tm);
        running = s.threads_running > 0;
      }
      if (running) {
        t.detach();
        detached = true;
      } else {
        t.join();
      }
    }
    s.threads.clear();
    // No thread of ours issues any more: drop our reference to the backend here, on the caller's
    // thread. Otherwise a late completion callback could end up holding the last reference to the
    // state, and through it to the scheduler's own ProcessGroupGloo, whose destructor would then run
    // on (and join) gloo's own worker thread: std::system_error "Resource deadlock avoided", abort.
    if (!detached) s.backend.reset();
    if (s.leader_fd >= 0) {
      ::close(s.leader_fd);
      s.leader_fd = -1;
    }
    for (int fd : s.follower_fds) ::close(fd);
    s.follower_fds.clear();
    return clean;
  }

  py::dict stats() const {
    py::dict d;
    d["partitions"] = s_->parts.load();
    d["sched_ns"] = s_->sched_ns.load();
    d["backend_ns"] = s_->backend_ns.load();
    d["backend_wall_ns"] = s_->backend_wall_ns.load();
    d["messages"] = s_->messages.load();
    d["send_ns"] = s_->send_ns.load();
    d["latency_ns"] = s_->latency_ns.load();
    d["latency_n"] = s_->latency_n.load();
    d["sparse_packed"] = s_->sparse_packed.load();
    return d;
  }

  // Per-partition timestamps (trace=True): (step, start, length, t_ready, t_issue0, t_issue1, t_done).
  py::list take_trace() {
    std::vector<TraceRecord> got;
    {
      std::lock_guard<std::mutex> g(s_->um);
      got.swap(s_->traces);
    }
    py::list out;
    for (auto& r : got)
      out.append(py::make_tuple(r.step, r.start, r.length, r.t_ready, r.t_issue0, r.t_issue1, r.t_done));
    return out;
  }

 private:
  std::shared_ptr<State> s_;
};

// ------------------------------------------------------------------ probes (benchmarks only)

// Stamps the moment a work's future completes, on the backend's thread, without the GIL: the
// Python path's callbacks run after it once they get the GIL (benchmarks/profile_partition.py).
class CompletionStamper {
 public:
  CompletionStamper() : times_(std::make_shared<Times>()) {}
  int64_t watch(const c10::intrusive_ptr<c10d::Work>& work) {
    int64_t index;
    {
      std::lock_guard<std::mutex> g(times_->m);
      index = int64_t(times_->t.size());
      times_->t.push_back(0.0);
    }
    auto times = times_;
    work->getFuture()->addCallback([times, index](c10::ivalue::Future&) {
      double t = now_s();
      std::lock_guard<std::mutex> g(times->m);
      times->t[index] = t;
    });
    return index;
  }
  std::vector<double> times() {
    std::lock_guard<std::mutex> g(times_->m);
    return times_->t;
  }

 private:
  struct Times {
    std::mutex m;
    std::vector<double> t;
  };
  std::shared_ptr<Times> times_;
};

// Issue `count` all-reduces of `tensor` from C++, `window` in flight at a time, waiting for each in
// order; returns per-collective (issue, done) times. The backend's floor without any Python.
py::list issue_loop(const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor tensor, int64_t count,
                    int64_t window) {
  std::vector<std::pair<double, double>> times(size_t(std::max<int64_t>(count, 0)));
  {
    py::gil_scoped_release no_gil;
    auto backend = group->getBackend(c10::DeviceType::CPU);
    std::deque<std::pair<int64_t, c10::intrusive_ptr<c10d::Work>>> inflight;
    c10d::AllreduceOptions opts;
    for (int64_t k = 0; k < count; ++k) {
      while (int64_t(inflight.size()) >= std::max<int64_t>(1, window)) {
        inflight.front().second->wait();
        times[inflight.front().first].second = now_s();
        inflight.pop_front();
      }
      std::vector<at::Tensor> tensors{tensor};
      times[k].first = now_s();
      inflight.emplace_back(k, backend->allreduce(tensors, opts));
    }
    while (!inflight.empty()) {
      inflight.front().second->wait();
      times[inflight.front().first].second = now_s();
      inflight.pop_front();
    }
  }
  py::list out;
  for (auto& t : times) out.append(py::make_tuple(t.first, t.second));
  return out;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "autobyte's native scheduler hot path (see native/engine.cpp)";
  m.attr("INTERFACE_VERSION") = kInterfaceVersion;
  m.attr("TORCH_VERSION") = AUTOBYTE_TORCH_VERSION;
  m.attr("UP_REDUCED") = kUpReduced;
  m.attr("UP_MARKER") = kUpMarker;
  m.attr("UP_CONFIG") = kUpConfig;
  m.attr("UP_ERROR") = kUpError;
  py::class_<Engine>(m, "Engine")
      .def(py::init<at::Tensor, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                    const c10::intrusive_ptr<c10d::ProcessGroup>&, bool, std::vector<int>, int, int, bool,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>(),
           py::arg("flat"), py::arg("sorted_offsets"), py::arg("by_offset"), py::arg("ext_len"),
           py::arg("group"), py::arg("leader"), py::arg("follower_fds"), py::arg("leader_fd"),
           py::arg("rank"), py::arg("trace") = false, py::arg("sparse_starts") = std::vector<int64_t>{},
           py::arg("sparse_rows") = std::vector<int64_t>{}, py::arg("sparse_cols") = std::vector<int64_t>{})
      .def("start_leader", &Engine::start_leader)
      .def("drain", &Engine::drain)
      .def("start_follower", &Engine::start_follower)
      .def("grad_ready", &Engine::grad_ready)
      .def("step_boundary", &Engine::step_boundary)
      .def("post_marker", &Engine::post_marker)
      .def("wait_updates", &Engine::wait_updates)
      .def("take_step_stats", &Engine::take_step_stats)
      .def("stop", &Engine::stop)
      .def("stats", &Engine::stats)
      .def("set_sparse_active", &Engine::set_sparse_active)
      .def("take_trace", &Engine::take_trace);
  py::class_<CompletionStamper>(m, "CompletionStamper")
      .def(py::init<>())
      .def("watch", &CompletionStamper::watch)
      .def("times", &CompletionStamper::times);
  m.def("issue_loop", &issue_loop, py::arg("group"), py::arg("tensor"), py::arg("count"), py::arg("window") = 1);
}
