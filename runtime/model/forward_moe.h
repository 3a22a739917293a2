/*
 * forward_moe.h — what the MoE all-to-all exchange (dp > 1, forward_moe.c)
 * tells the outside: its mode and how long its exchanges took, for
 * `flotilla bench` (the fraction of exchange time the
 * two-micro-batch overlap hides). The forward-internal entry points stay in
 * forward_impl.h.
 *
 * Mode: fl_forward_config.moe_overlap (--moe-overlap, the moe_overlap config
 * key, FL_MOE_OVERLAP), read when the exchange is enabled
 * (fl_forward_moe_enable_a2a), agreed over the ep group (any rank asking
 * for one micro-batch makes every rank use one, since the ranks must run
 * the same collectives):
 *   on (1)         two micro-batches (A: the rows for the first half of each
 *                  ep rank's experts, B: the rest); on CUDA with NCCL on its
 *                  own stream the exchange of one overlaps the other's
 *                  experts (events, no host waits); elsewhere (CPU/MPI) the
 *                  same schedule in order
 *   serial (2)     two micro-batches, in order with host syncs (the schedule
 *                  without the overlap: measures the split's own cost)
 *   off (0)        one exchange each way, in order (the default: measured,
 *                  the overlap pays at batch 64 and costs at 256; see
 *                  docs/parallel.md)
 *   alternate (3)  off and on by turns, one decode step each (a step's MoE
 *                  layers all in one mode): bench's one-run comparison, under
 *                  the same batch and context lengths; used only if every
 *                  rank of the group asks for it (else on)
 * moe_micro_batches n (--moe-micro-batches, FL_MOE_MICRO_BATCHES; 2..8,
 * default 2; agreed as the group's smallest,
 * at most one per local expert): split into n micro-batches instead of two
 * (each a consecutive range of every rank's experts); only the first and
 * last transfers stay exposed, but each adds two all-to-alls per layer.
 * Every mode computes the same rows with the same experts in the same order,
 * so the results are bitwise equal across modes.
 */
#ifndef FL_FORWARD_MOE_H
#define FL_FORWARD_MOE_H

#include <stdbool.h>

/* The largest moe_micro_batches. */
enum { FL_MOE_MICRO_BATCHES_MAX = 8 };

/* The values are the indexes of FL_MOE_OVERLAP's choices in
 * core/option_list.h ("off|on|serial|alternate"). */
typedef enum fl_moe_overlap {
    FL_MOE_OVERLAP_OFF = 0,   /* one micro-batch, host syncs around each exchange */
    FL_MOE_OVERLAP_ON = 1,    /* two micro-batches, ordered by events where the backend can */
    FL_MOE_OVERLAP_SERIAL = 2, /* two micro-batches, host syncs around each exchange */
    FL_MOE_OVERLAP_ALTERNATE = 3 /* OFF and ON by turns, one step each */
} fl_moe_overlap;

/* Process-wide totals over every forward with the exchange on (like
 * fl_forward_graph_totals: bench reads rank 0's). */
typedef struct fl_moe_exchange_stats {
    bool enabled;          /* some forward has the all-to-all exchange */
    int mode;              /* fl_moe_overlap in effect (the last forward enabled) */
    int micro_batches;     /* exchanges each way per layer when split (1: not split) */
    bool events;           /* the backend can order the micro-batches by events (no host syncs) */
    int last_mode;         /* OFF, ON or SERIAL: what the latest layer exchange ran (alternate
                              mode: read after a step to attribute its time) */
    long layers;           /* MoE layer exchanges run (idle replicas' included) */
    long timed_layers;     /* of which the activation exchange was host-timed (in-order modes) */
    double act_s;          /* activation all-to-alls (there and back), host-timed: collective +
                              wait, after the compute queue was drained; 0 when overlapped */
    double ctrl_s;         /* count and expert-id exchanges, host-timed (always synchronous;
                              the ids' download included) */
    double act_bytes;      /* activation bytes this rank sent to the other ranks of its ep
                              group in the host-timed exchanges (act_s): with it, the
                              exchange's achieved bandwidth inside the layer */
} fl_moe_exchange_stats;

void fl_forward_moe_totals(fl_moe_exchange_stats *out);
/* Zeroes the counters (keeps enabled/mode/events) and the expert reads: e.g.
 * after prefill. */
void fl_forward_moe_totals_reset(void);
/* Routed experts whose weights this rank read in the MoE layers of decode
 * steps (every row a sequence's one new token, graph padding rows
 * included: they are routed and read too; an idle replica's exchanges
 * count as well), process-wide since the last fl_forward_moe_totals_reset:
 * what bench turns into the bytes a step reads. The host-routed paths know
 * the distinct experts of each layer exactly (the pairs are sorted by
 * expert on the host). The device-routed path (forward_moe_dev.c) keeps a
 * grouping per layer and counts them after the step: in place on the CPU
 * backend; on a GPU only with fl_forward_config.count_experts (one download
 * after the step's sync), else those layers count in `layers` but not in
 * `counted`. */
typedef struct fl_moe_expert_reads {
    long layers;  /* MoE layer forwards of decode steps */
    long counted; /* of which the distinct experts were counted */
    long experts; /* distinct local experts with routed rows, summed over the counted layers */
} fl_moe_expert_reads;

void fl_forward_moe_expert_reads(fl_moe_expert_reads *out);

/* "off", "on", "serial", "alternate"; "?" otherwise. */
const char *fl_moe_overlap_name(int mode);

#endif /* FL_FORWARD_MOE_H */
